// The smallest chat page on the browser client, for the end-to-end test (e2e.py). Its query
// says who it is: `gateways` (comma-separated base URLs; the module comes from the first),
// `token`, `me`, `peer`, `conversation`. Every event the client announces is kept in
// `window.presenceLog`, so the test can check what the page saw, not only what it shows now.
const query = new URLSearchParams(location.search);
const gateways = query.get("gateways").split(",");
const me = query.get("me");
const peer = query.get("peer");
const conversation = query.get("conversation");
const { PresenceClient, PresenceText } = await import(`${gateways[0]}/client/presence.js`);

/** @type {Array<{type: string, detail: any, at: number}>} */
window.presenceLog = [];
const client = new PresenceClient({ gatewayURLs: gateways, token: async () => query.get("token") });
window.presenceClient = client;

const text = (id, value) => { document.getElementById(id).textContent = value; };
text("me", me);
text("peer-name", peer);

const showPeer = () => text("peer-status", PresenceText.status(client.presence(peer) ?? null, Date.now()));
const showTyping = () => text("typing", PresenceText.typing(client.typingUsers(conversation)));
for (const type of ["connection", "presence", "removed", "typing", "group", "error"]) {
  client.addEventListener(type, (event) => {
    window.presenceLog.push({ type, detail: event.detail, at: Date.now() });
    if (type === "connection") text("connection", event.detail.state);
    if (type === "presence") showPeer();
    if (type === "typing") showTyping();
    if (type === "group") text("group", PresenceText.group(event.detail));
  });
}
setInterval(showPeer, 1000);
document.getElementById("composer").addEventListener("input", () => client.userTyped(conversation));
client.start();
client.join(conversation);
client.watch([peer]);
window.presenceReady = true;
