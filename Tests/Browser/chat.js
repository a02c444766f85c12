// A chat page on the browser client, for the messaging end-to-end test (messaging.py). Its
// query: `gateways` (comma-separated; the module comes from the first), `token`, `me`, `peer`,
// `conversation`. The conversation is on screen: while the page is visible what arrives is read.
// The "offline" box is the SDK's offline switch. Each message is a list item whose data
// attributes the test reads; every event is kept in `window.presenceLog`.
import { client, conversation, me, peer, PresenceText, text } from "./page.js";

function showMessages() {
  const list = document.getElementById("messages");
  list.replaceChildren(...client.messages(conversation).map((message) => {
    const item = document.createElement("li");
    item.dataset.clientId = message.clientMessageId;
    item.dataset.seq = message.seq === null ? "" : String(message.seq);
    item.dataset.status = message.status;
    item.dataset.text = message.text;
    const label = message.status === "sending" && client.connectionState.state !== "connected" ? "Not delivered" : message.status;
    item.textContent = `${message.senderId ?? me}: ${message.text} [${label}]`;
    return item;
  }));
}
const showPeer = () => text("peer-status", PresenceText.status(client.presence(peer) ?? null, Date.now()));
const showTyping = () => text("typing", PresenceText.typing(client.typingUsers(conversation)));
for (const type of ["connection", "presence", "typing", "error", "message", "messagestatus", "messagegap"]) {
  client.addEventListener(type, (event) => {
    window.presenceLog.push({ type, detail: event.detail, at: Date.now() });
    if (type === "connection") {
      text("connection", event.detail.state);
      showTyping();
    }
    if (type === "presence") showPeer();
    if (type === "typing") showTyping();
    if (type.startsWith("message") || type === "connection") showMessages();
  });
}
setInterval(showTyping, 500);
const composer = document.getElementById("composer");
composer.addEventListener("input", () => client.userTyped(conversation));
document.getElementById("composer-form").addEventListener("submit", (event) => {
  event.preventDefault();
  if (composer.value === "") return;
  client.send(conversation, composer.value);
  client.messageSent(conversation);
  composer.value = "";
});
document.getElementById("offline").addEventListener("change", (event) => client.setOffline(event.target.checked));
client.start();
client.join(conversation);
client.watch([peer]);
client.showConversation(conversation);
showMessages();
window.presenceReady = true;
