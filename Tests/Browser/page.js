// What both test pages (app.js, chat.js) start with: their query, and a browser client on the
// gateways it names. The query: `gateways` (comma-separated base URLs; the module comes from
// the first), `token`, `me`, `peer`, `conversation`. Every event the page's client announces is
// to be kept in `window.presenceLog`, so the test can check what the page saw, not only what it
// shows now.
const query = new URLSearchParams(location.search);
const gateways = query.get("gateways").split(",");
export const me = query.get("me");
export const peer = query.get("peer");
export const conversation = query.get("conversation");
export const { PresenceClient, PresenceText } = await import(`${gateways[0]}/client/presence.js`);

/** @type {Array<{type: string, detail: any, at: number}>} */
window.presenceLog = [];
export const client = new PresenceClient({ gatewayURLs: gateways, token: async () => query.get("token") });
window.presenceClient = client;

/** Sets the text of the element `id`. */
export const text = (id, value) => { document.getElementById(id).textContent = value; };
text("me", me);
text("peer-name", peer);
