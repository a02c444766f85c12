// The smallest chat page on the browser client, for the end-to-end test (e2e.py); its query and
// client are page.js's.
import { client, conversation, peer, PresenceText, text } from "./page.js";

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
