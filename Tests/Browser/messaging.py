#!/usr/bin/python3
"""Seed 004's offline messaging end to end, in headless Chromium, with two chat pages.

Run beside a Redis (scripts/with-redis sets PRESENCE_REDIS_URL) after `swift build`, as root for
the network cut (iptables):
    scripts/with-redis Tests/Browser/messaging.py [--screenshots DIR]

Alice's page (Tests/Browser/chat.*) talks to node A, Bob's to node B (one Redis). Checked:
  1. with Alice's offline switch on, typing is neither sent nor shown on either side; switched
     back, typing works both ways;
  2. five messages written offline show "Not delivered" (sending); switched back, all five reach
     Bob's page in order within 3 s, and each ends "read" on Alice's page, as Bob's page shows them;
  3. offline/online cycles on both pages (Alice 3, Bob 2, Alice 12 messages) leave both pages
     with the same complete history;
  4. a reload while offline keeps the outbox (IndexedDB): its messages reach Bob once each;
  5. a real network cut: iptables drops every packet between the browser and node A's port (the
     WebSocket stays open, as on a dead network) and the page is told `offline`, as the
     operating system's network change would tell the browser (Chromium's own offline emulation
     leaves open WebSockets connected); five messages written meanwhile wait ("Not delivered")
     and Bob's typing is not shown; the cut removed and `online` told, the five reach Bob in
     order within 3 s;
  6. the dashboard's conversation card shows the newest 50 messages as the pages have them, each
     "read" (both pages show the conversation), and the members' cursors at the last seq;
  7. Alice's page follows 30 more conversations (12 with Bob, 18 groups), goes offline while Bob
     writes two messages in each of the 12, and comes back: all 24 are shown once, in order, and
     no error reaches the page (the catch-up is never refused);
  8. two tabs of Alice's (one browser: one localStorage, one set of Web Locks) on a fresh
     conversation, on nodes A and B: each holds a tab slot of its own, so they connect as two
     devices (the pages' device ids and the admin view agree) and neither is replaced (4009);
     Bob's message shows in both tabs, and one written in tab 1 reaches Bob once and shows in
     tab 2; then tab 2, offline, writes a message and is closed: tab 1, shown again, adopts the
     closed tab's outbox, the message reaches Bob once, and the closed tab's outbox is empty.
A check that cannot run (Chromium does not start, iptables refuses) is a failure with its reason.

The pages load the browser client from node A, as an app would: the run stops at once, saying so,
when node A's binary serves another presence.js than Sources/PresenceWebClient/presence.js (built
before the last change to it), as it would test a module that is not the one in the tree.
"""
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

sys.dont_write_bytecode = True  # importing e2e leaves no __pycache__ in the tree
from e2e import ADMIN, ROOT, check, fail, request, run_of, screenshot, token, wait_until

CONVERSATION = "room"
TABS_CONVERSATION = "tabs"


def check_module(node):
    """Stops the run when the node serves another presence.js than the source file (a stale build)."""
    with urllib.request.urlopen(f"{node.url}/client/presence.js", timeout=5) as answer:
        served = answer.read()
    with open(os.path.join(ROOT, "Sources/PresenceWebClient/presence.js"), "rb") as file:
        source = file.read()
    if served != source:
        fail("the gateway binary serves another presence.js than Sources/PresenceWebClient/presence.js: run `swift build` first")


def messages(driver):
    """The page's messages as it shows them: seq (None until stored), status, text."""
    return driver.execute_script("""
        return [...document.querySelectorAll('#messages li')].map((item) => ({
          seq: item.dataset.seq === '' ? null : Number(item.dataset.seq), status: item.dataset.status,
          text: item.dataset.text, shown: item.textContent }));""")


def stored(driver):
    return [(entry["seq"], entry["text"]) for entry in messages(driver) if entry["seq"] is not None]


def connection(driver):
    return driver.find_element("id", "connection").text


def switch_offline(driver, offline):
    box = driver.find_element("id", "offline")
    if box.is_selected() != offline:
        box.click()
    wait_until(lambda: connection(driver) == ("idle" if offline else "connected"), 10, f"the page {'off' if offline else 'on'}line")


def write(driver, text):
    from selenium.webdriver.common.keys import Keys
    driver.find_element("id", "composer").send_keys(text + Keys.ENTER)


def typing_shown(driver):
    return driver.find_element("id", "typing").text


def stopped_or_replaced(driver):
    """What of the page's life says its client was stopped for good or replaced (4009); empty if nothing."""
    return driver.execute_script("""
        const said = window.presenceLog.filter((e) => e.type === 'connection' && e.detail.state === 'stopped').map((e) => e.detail.reason);
        return window.presenceClient.lastCloseCode === 4009 ? [...said, 'closed with 4009'] : said;""")


def held_locks(driver):
    """The names of the Web Locks held in the page's origin (every tab's)."""
    return driver.execute_async_script(
        "const done = arguments[0]; navigator.locks.query().then((state) => done(state.held.map((lock) => lock.name)));")


def stored_outbox(driver, device_id):
    """The IndexedDB outbox record the client keeps for a device id (None: none)."""
    return driver.execute_async_script("""
        const [key, done] = arguments;
        const open = indexedDB.open('presence', 1);
        open.onupgradeneeded = () => open.result.createObjectStore('outbox');
        open.onsuccess = () => {
          const read = open.result.transaction('outbox').objectStore('outbox').get(key);
          read.onsuccess = () => { open.result.close(); done(read.result ?? null); };
        };""", device_id)


class Cut:
    """iptables rules dropping every packet to and from a TCP port on this machine, tagged with this
    process's id: should it be killed before it removes them, scripts/clear-stale-cuts does."""

    def __init__(self, port):
        self.tag = f"presence-test-{os.getpid()}"
        self.rules = [["INPUT", "-p", "tcp", "--dport", str(port)], ["INPUT", "-p", "tcp", "--sport", str(port)]]
        self.active = False

    def iptables(self, action, rule):
        command = [shutil.which("iptables") or "/usr/sbin/iptables", action, *rule, "-m", "comment", "--comment", self.tag, "-j", "DROP"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            fail(f"iptables {' '.join(command[1:])} refused ({result.stderr.strip()}): the network cut needs root and iptables")

    def __enter__(self):
        for rule in self.rules:
            self.iptables("-I", rule)
        self.active = True
        return self

    def remove(self):
        if self.active:
            for rule in self.rules:
                self.iptables("-D", rule)
            self.active = False

    def __exit__(self, *_):
        self.remove()


def main():
    with run_of(__doc__.splitlines()[0], "messaging", "chat.html") as run:
        arguments, chat = run.arguments, run.page
        a = run.node("node-a")
        b = run.node("node-b")
        request("PUT", f"{b.url}/api/admin/conversations/{CONVERSATION}", {"member_ids": ["alice", "bob"]})
        check_module(a)

        def page(user, peer, node, conversation=CONVERSATION):
            fields = {"gateways": node.url, "token": token(user), "me": user, "peer": peer, "conversation": conversation}
            return f"{chat}?{urllib.parse.urlencode(fields)}"

        alice = run.browser("alice")
        bob = run.browser("bob")
        alice.get(page("alice", "bob", a))
        bob.get(page("bob", "alice", b))
        for driver, name in [(alice, "Alice"), (bob, "Bob")]:
            wait_until(lambda driver=driver: connection(driver) == "connected", 10, f"{name}'s page connected")
        wait_until(lambda: bob.find_element("id", "peer-status").text == "Online", 5, "Bob sees Alice online")

        # 1. Typing while offline: neither sent nor shown; back online, it works both ways.
        switch_offline(alice, True)
        wait_until(lambda: bob.find_element("id", "peer-status").text.startswith("Last seen"), 5, "Bob sees Alice offline (her switch closes cleanly)")
        write_keys = alice.find_element("id", "composer")
        bob_box = bob.find_element("id", "composer")
        for key in "hey":
            write_keys.send_keys(key)
            bob_box.send_keys(key)
            time.sleep(0.2)
        time.sleep(1)
        check(typing_shown(bob) == "", "offline: Alice's typing does not reach Bob's page")
        check(typing_shown(alice) == "", "offline: Bob's typing is not shown on Alice's page")
        write_keys.clear()
        bob_box.clear()
        switch_offline(alice, False)
        time.sleep(3.5)  # the earlier indicators have ended
        for key in "back":
            bob_box.send_keys(key)
            time.sleep(0.2)
        wait_until(lambda: typing_shown(alice) == "bob is typing…", 3, "online again: Alice's page shows Bob typing")
        for key in "back":
            write_keys.send_keys(key)
            time.sleep(0.2)
        wait_until(lambda: typing_shown(bob) == "alice is typing…", 3, "online again: Bob's page shows Alice typing")
        check(True, "typing works both ways after the switch is off")
        write_keys.clear()
        bob_box.clear()
        time.sleep(3.5)

        # 2. Five messages written offline: "Not delivered", then all five to Bob in order within 3 s, then read.
        switch_offline(alice, True)
        five = [f"offline {number}" for number in range(1, 6)]
        for text in five:
            write(alice, text)
        wait_until(lambda: len(messages(alice)) == 5, 3, "Alice's page lists the five")
        check(all(entry["status"] == "sending" and "[Not delivered]" in entry["shown"] for entry in messages(alice)),
              "each shows \"Not delivered\" while offline")
        time.sleep(0.5)
        check(stored(bob) == [], "Bob has none of them while Alice is offline")
        online_at = time.monotonic()
        switch_offline(alice, False)
        wait_until(lambda: len(stored(bob)) == 5, 3, "all five reach Bob's page")
        check(True, f"all five reached Bob's page {time.monotonic() - online_at:.2f} s after Alice's switch went off (bound 3 s)")
        check(stored(bob) == list(zip(range(1, 6), five)), f"in order, seqs 1-5: {stored(bob)}")
        wait_until(lambda: [entry["status"] for entry in messages(alice)] == ["read"] * 5, 5, "each ends \"read\" on Alice's page")
        check(True, "each of the five ends \"read\" on Alice's page (Bob's page shows the conversation)")
        screenshot(alice, arguments.screenshots, "chat-alice", ["messages", "composer"])
        screenshot(bob, arguments.screenshots, "chat-bob", ["messages", "composer"])

        # 3. Offline/online cycles on both pages: the same complete history on both.
        expected = list(five)
        for driver, name, count in [(alice, "alice", 3), (bob, "bob", 2), (alice, "alice", 12)]:
            switch_offline(driver, True)
            for number in range(1, count + 1):
                text = f"{name} {len(expected) + 1} ({number} of {count})"
                expected.append(text)
                write(driver, text)
            switch_offline(driver, False)
        for driver, name in [(alice, "Alice"), (bob, "Bob")]:
            wait_until(lambda driver=driver: len(stored(driver)) == len(expected), 10, f"{name}'s page has all {len(expected)} messages")
        check(stored(alice) == stored(bob) == list(zip(range(1, len(expected) + 1), expected)),
              f"both pages have the same complete history of {len(expected)} messages, in the order written")

        # 4. A reload while offline keeps the outbox; its messages reach Bob once each.
        switch_offline(alice, True)
        kept = ["kept through a reload 1", "kept through a reload 2"]
        for text in kept:
            write(alice, text)
        wait_until(lambda: len(messages(alice)) == len(expected) + 2, 3, "Alice's page lists the two")
        alice.execute_async_script("const done = arguments[0]; window.presenceClient.outboxSaved().then(() => done(true));")
        alice.refresh()
        wait_until(lambda: alice.execute_script("return window.presenceReady === true"), 10, "Alice's page loaded again")
        expected += kept
        wait_until(lambda: len(stored(bob)) == len(expected), 5, "the two reach Bob's page after the reload")
        time.sleep(1)
        texts = [text for _, text in stored(bob)]
        check(all(texts.count(text) == 1 for text in kept) and len(texts) == len(expected), "each reached Bob once, after the reload")

        # 5. A real network cut between Alice's browser and node A.
        started = len(stored(bob))
        with Cut(a.port) as cut:
            alice.execute_script("window.dispatchEvent(new Event('offline'))")
            wait_until(lambda: connection(alice) == "idle", 10, "Alice's page gives its session up")
            cut_texts = [f"cut {number}" for number in range(1, 6)]
            for text in cut_texts:
                write(alice, text)
            bob_box.send_keys("x")
            time.sleep(1)
            check(typing_shown(alice) == "", "cut off: Bob's typing is not shown on Alice's page")
            check(len(stored(bob)) == started, "cut off: nothing of Alice's reaches Bob")
            check(all(entry["status"] == "sending" and "[Not delivered]" in entry["shown"] for entry in messages(alice)[-5:]),
                  "cut off: the five show \"Not delivered\"")
            cut.remove()
            back_at = time.monotonic()
            alice.execute_script("window.dispatchEvent(new Event('online'))")
            wait_until(lambda: len(stored(bob)) == started + 5, 3, "after the cut, the five reach Bob's page")
            check(True, f"after the cut the five reached Bob {time.monotonic() - back_at:.2f} s after the network came back (bound 3 s)")
            check([text for _, text in stored(bob)[started:]] == cut_texts, "in the order written")

        # 6. The dashboard's view of the conversation.
        board = run.browser("board")
        board.get(f"{b.url}/dashboard")
        board.find_element("id", "token-input").send_keys(ADMIN)
        board.find_element("css selector", "#token-form button[type=submit], #token-form button").click()
        history = stored(alice)
        wait_until(lambda: stored(bob) == history, 5, "both pages have the same history before the dashboard reads it")

        def shown_rows():
            field = board.find_element("id", "conversation-id")
            field.clear()
            field.send_keys(CONVERSATION)
            board.find_element("css selector", "#conversation-form button").click()
            time.sleep(0.3)
            return [(int(row.get_attribute("data-seq")), row.find_elements("css selector", "td")[2].text, row.get_attribute("data-status"))
                    for row in board.find_elements("css selector", "#conversation-result tr[data-seq]")]

        def all_read():
            found = shown_rows()
            return found if found and all(status == "read" for _, _, status in found) else None
        rows = wait_until(all_read, 10, "the dashboard shows the conversation, every message read")
        newest = sorted(history)[-50:]
        check(sorted((seq, text) for seq, text, _ in rows) == newest, f"the dashboard's {len(rows)} messages are the pages' newest {len(newest)}")
        check([seq for seq, _, _ in rows] == sorted((seq for seq, _ in newest), reverse=True), "newest first")
        cursors = {row.get_attribute("data-user-id"): [cell.text for cell in row.find_elements("css selector", "td")[1:]]
                   for row in board.find_elements("css selector", ".conversation-members tr[data-user-id]")}
        last = str(len(history))
        check(cursors == {"alice": [last, last], "bob": [last, last]}, f"both members' cursors are at {last}: {cursors}")
        screenshot(board, arguments.screenshots, "dashboard-conversation", ["conversation-result"])

        # 7. Thirty conversations followed (12 written to while offline, 18 more groups): back
        # online, every message shown once, in order, and no refusal.
        talks = [f"talk{number}" for number in range(12)]
        groups = [f"group{number}" for number in range(18)]
        for conversation in talks:
            request("PUT", f"{b.url}/api/admin/conversations/{conversation}", {"member_ids": ["alice", "bob"]})
        for conversation in groups:
            request("PUT", f"{b.url}/api/admin/conversations/{conversation}", {"member_ids": ["alice", "bob", "carol"]})
        alice.execute_script("window.presenceErrors = []; window.presenceClient.addEventListener('error', (event) => window.presenceErrors.push(event.detail));")
        for conversation in talks + groups:
            alice.execute_script("window.presenceClient.join(arguments[0])", conversation)
        switch_offline(alice, True)
        wait_until(lambda: connection(alice) == "idle", 10, "Alice's page goes offline with 30 more conversations")
        for conversation in talks:
            for number in (1, 2):
                request("POST", f"{a.url}/api/conversations/{conversation}/messages",
                        {"client_message_id": f"{conversation}-{number}", "text": f"{conversation} #{number}"}, bearer=token("bob"))
        back_at = time.monotonic()
        switch_offline(alice, False)

        def shown(conversation):
            return alice.execute_script("return window.presenceClient.messages(arguments[0]).map((m) => [m.seq, m.text])", conversation)
        wait_until(lambda: all(len(shown(conversation)) >= 2 for conversation in talks), 15, "each of the 12 conversations shows its two messages")
        check(True, f"the 24 messages written while Alice was offline were all shown {time.monotonic() - back_at:.2f} s after she went online")
        check(all(shown(conversation) == [[1, f"{conversation} #1"], [2, f"{conversation} #2"]] for conversation in talks),
              "once each, in order, in every conversation")
        errors = alice.execute_script("return window.presenceErrors.map((e) => `${e.code}: ${e.message}`)")
        check(errors == [], f"no error on Alice's page: {errors}")

        # 8. Two tabs of Alice's on a fresh conversation: a device each, every message in both,
        # and a closed tab's unsent message adopted by the other.
        request("PUT", f"{b.url}/api/admin/conversations/{TABS_CONVERSATION}", {"member_ids": ["alice", "bob"]})
        bob.get(page("bob", "alice", b, TABS_CONVERSATION))
        alice.get(page("alice", "bob", a, TABS_CONVERSATION))
        tab1 = alice.current_window_handle
        wait_until(lambda: connection(alice) == "connected", 10, "Alice's tab 1 connected")
        alice.switch_to.new_window("tab")
        tab2 = alice.current_window_handle
        alice.get(page("alice", "bob", b, TABS_CONVERSATION))
        wait_until(lambda: connection(alice) == "connected", 10, "Alice's tab 2 connected")
        wait_until(lambda: connection(bob) == "connected", 10, "Bob's page on the conversation connected")
        device_ids = {}
        for handle, name in [(tab1, "tab 1"), (tab2, "tab 2")]:
            alice.switch_to.window(handle)
            wait_until(lambda: connection(alice) == "connected", 10, f"Alice's {name} still connected once both are open")
            device_ids[name] = alice.execute_script("return window.presenceClient.deviceId")
        stored_id = alice.execute_script("return localStorage.getItem('presence.device_id')")
        check(device_ids == {"tab 1": stored_id, "tab 2": f"{stored_id}.tab2"},
              f"the two tabs connect as two devices, slots 1 and 2 of the stored id {stored_id}: {device_ids}")
        devices = {device["device_id"] for device in request("GET", f"{a.url}/api/admin/users/alice")["devices"]}
        check(set(device_ids.values()) <= devices, f"the gateway has both of Alice's tabs as devices: {sorted(devices)}")

        def shown_in(handle, text, count=1):
            alice.switch_to.window(handle)
            return [seen for _, seen in stored(alice)].count(text) == count

        from_bob = "from bob to both tabs"
        write(bob, from_bob)
        for handle, name in [(tab1, "tab 1"), (tab2, "tab 2")]:
            wait_until(lambda handle=handle: shown_in(handle, from_bob), 5, f"Bob's message shows in Alice's {name}")
        check(True, "Bob's message shows in both of Alice's tabs")
        from_tab1 = "from alice's tab 1"
        alice.switch_to.window(tab1)
        write(alice, from_tab1)
        wait_until(lambda: [text for _, text in stored(bob)].count(from_tab1) >= 1, 5, "the message of Alice's tab 1 reaches Bob")
        wait_until(lambda: shown_in(tab2, from_tab1), 5, "the message of Alice's tab 1 shows in her tab 2")
        time.sleep(1)
        check([text for _, text in stored(bob)] == [from_bob, from_tab1], f"Bob has each message once, in order: {stored(bob)}")
        check(shown_in(tab1, from_tab1) and shown_in(tab2, from_tab1), "Alice's two tabs have it once each")
        for handle, name in [(tab1, "tab 1"), (tab2, "tab 2")]:
            alice.switch_to.window(handle)
            check(stopped_or_replaced(alice) == [] and connection(alice) == "connected", f"Alice's {name} was never stopped nor replaced")

        # A closed tab's outbox: tab 2 writes offline, then is closed; tab 1 shown again adopts it.
        alice.switch_to.window(tab2)
        switch_offline(alice, True)
        orphan = "written in a tab closed before it went out"
        write(alice, orphan)
        wait_until(lambda: [entry["text"] for entry in messages(alice)].count(orphan) == 1, 3, "tab 2 lists the message it wrote offline")
        alice.execute_async_script("const done = arguments[0]; window.presenceClient.outboxSaved().then(() => done(true));")
        kept = [entry["text"] for entry in stored_outbox(alice, device_ids["tab 2"]) or []]
        check(kept == [orphan], f"tab 2's outbox (IndexedDB, under its device id) holds the message: {kept}")
        alice.close()
        alice.switch_to.window(tab1)
        # Shown again once the closed tab's lock is gone, whatever its switch to the front did.
        wait_until(lambda: f"presence.device-slot:{stored_id}:2" not in held_locks(alice), 10, "the closed tab's slot is free")
        alice.minimize_window()
        alice.maximize_window()
        wait_until(lambda: orphan in [text for _, text in stored(bob)], 5, "the closed tab's message reaches Bob once tab 1 is shown again")
        time.sleep(1)
        check([text for _, text in stored(bob)].count(orphan) == 1, "the closed tab's message reached Bob once")
        check(shown_in(tab1, orphan), "tab 1 shows the message it adopted, stored")
        wait_until(lambda: stored_outbox(alice, device_ids["tab 2"]) == [], 3, "the closed tab's outbox emptied")
        check(True, "the closed tab's outbox is emptied once tab 1 has adopted it")
        check(stopped_or_replaced(alice) == [], "tab 1 was never stopped nor replaced")
        print("messaging: all checks passed")


if __name__ == "__main__":
    main()
