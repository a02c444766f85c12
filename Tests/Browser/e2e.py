#!/usr/bin/python3
"""The browser client and the dashboard end to end, in headless Chromium, against two gateway nodes.

Run beside a Redis (scripts/with-redis sets PRESENCE_REDIS_URL) after `swift build`:
    scripts/with-redis Tests/Browser/e2e.py [--screenshots DIR]

Two pages of a small chat app (Tests/Browser/app.*, served from a local HTTP server; the module
comes from the gateway) are Alice (node A first, then B) and Bob (node B first); a third browser
shows the dashboard. Checked, each with the time it took:
  1. Bob sees Alice online within 1 s of her page loading;
  2. Alice's window minimized (the page is hidden) -> Bob sees away; shown again -> online;
  3. typing in Alice's box -> Bob shows "alice is typing…", gone about 3 s after the last key;
  4. the dashboard's counts, nodes, users, event tail and user lookup match presencectl's;
  5. node A killed -> Alice's page reconnects to node B and Bob never sees her offline, past the
     lease and a reaper pass;
  6. Alice's tab closed -> Bob sees offline at once.
Each page is screenshot and the screenshot checked (not blank). Chromium that cannot start is a
failure with its reason, never a skip. Uses Debian's python3-selenium, chromium and
chromium-driver (scripts/install-deps installs them).
"""
import argparse
import base64
import contextlib
import hashlib
import hmac
import http.server
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "browser-test-secret-that-is-long-enough"
ADMIN = "browser-test-admin-token"
LEASE = 3


def fail(message):
    print(f"e2e: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)
    print(f"e2e: ok: {message}")


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def token(user):
    def b64(data):
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    header = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    payload = b64(json.dumps({"sub": user, "exp": int(time.time()) + 3600}).encode())
    signature = b64(hmac.new(SECRET.encode(), f"{header}.{payload}".encode(), hashlib.sha256).digest())
    return f"{header}.{payload}.{signature}"


def request(method, url, body=None, bearer=ADMIN):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Authorization": f"Bearer {bearer}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as answer:
        return json.loads(answer.read() or b"null")


def wait_until(condition, timeout, what, poll=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    fail(f"{what}: not within {timeout} s")


class Node:
    """One gateway node process on a free port."""

    def __init__(self, name, binary, redis_url, prefix, log_dir):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        environment = dict(os.environ, PRESENCE_PORT=str(self.port), PRESENCE_REDIS_URL=redis_url, PRESENCE_KEY_PREFIX=prefix,
                           PRESENCE_NODE_ID=name, PRESENCE_JWT_SECRET=SECRET, PRESENCE_ADMIN_TOKEN=ADMIN,
                           PRESENCE_LEASE_TTL=str(LEASE))
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        self.process = subprocess.Popen([binary], env=environment, stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(self.ready, 30, f"node {name} ready")

    def ready(self):
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=1) as answer:
                return answer.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def png_is_blank(png):
    """Whether a screenshot is one flat colour (or unreadable): decodes the PNG's pixels."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        return True
    position, idat, width = 8, b"", 0
    while position < len(png):
        length, kind = struct.unpack(">I4s", png[position:position + 8])
        chunk = png[position + 8:position + 8 + length]
        if kind == b"IHDR":
            width = struct.unpack(">I", chunk[:4])[0]
        elif kind == b"IDAT":
            idat += chunk
        position += 12 + length
    pixels = zlib.decompress(idat)
    # Rows start with a filter byte; a flat image filtered any way has few distinct row bytes.
    stride = len(pixels) // max(1, len(pixels) // (width * 4 + 1)) if width else 0
    distinct = set()
    for start in range(0, len(pixels), max(1, stride)):
        distinct.update(pixels[start + 1:start + 1 + min(stride - 1, 4000)])
        if len(distinct) > 8:
            return False
    return True


def screenshot(driver, directory, name, must_show):
    png = driver.get_screenshot_as_png()
    path = os.path.join(directory, f"{name}.png")
    with open(path, "wb") as file:
        file.write(png)
    check(not png_is_blank(png), f"screenshot {path} is not blank ({len(png)} bytes)")
    for element_id in must_show:
        shown = driver.execute_script("const e = document.getElementById(arguments[0]); return !!e && e.getClientRects().length > 0", element_id)
        check(shown, f"{name}: #{element_id} is on the page")


def browser(profile):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    for argument in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                     f"--user-data-dir={profile}", "--no-first-run", "--disable-background-timer-throttling"]:
        options.add_argument(argument)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    try:
        return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=options)
    except Exception as error:  # noqa: BLE001 — any reason Chromium did not start is the failure
        fail(f"Chromium could not start: {error}")


def log_of(driver):
    return driver.execute_script("return window.presenceLog || []")


def peer_events(driver, user, since_ms=0):
    return [entry for entry in log_of(driver) if entry["type"] == "presence" and entry["detail"]["userId"] == user and entry["at"] >= since_ms]


def json_values(text):
    """The JSON values written one after another (presencectl prints each event pretty-printed)."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position >= len(text):
            return values
        value, position = decoder.raw_decode(text, position)
        values.append(value)


def json_values_so_far(text):
    """The whole JSON values at the start of `text`, which may end in the middle of one."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return values
        values.append(value)


def read_until(stream, done, seconds):
    """What `stream` (a text pipe) gives until `done(all so far)` or `seconds` pass."""
    text, deadline = "", time.time() + seconds
    while not done(text) and time.time() < deadline:
        ready, _, _ = select.select([stream], [], [], max(0, deadline - time.time()))
        if not ready:
            break
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:
            break
        text += chunk.decode()
    return text


def presencectl(arguments, redis_url, prefix):
    binary = os.path.join(ROOT, ".build/debug/presencectl")
    output = subprocess.run([binary, *arguments, "--json", "--redis-url", redis_url, "--key-prefix", prefix], check=True, capture_output=True, text=True, timeout=30)
    return json.loads(output.stdout)


class Run:
    """One browser test's world: its arguments, Redis, a key prefix of its own, a scratch folder, the
    test pages served over HTTP, and the nodes and browsers it started (stopped at its end)."""

    def __init__(self, description, name, page):
        parser = argparse.ArgumentParser(description=description)
        parser.add_argument("--screenshots", default=os.path.join(ROOT, ".build/browser"), help="where the screenshots go")
        self.arguments = parser.parse_args()
        self.redis_url = os.environ.get("PRESENCE_REDIS_URL") or fail("PRESENCE_REDIS_URL is not set: run under scripts/with-redis")
        self.binary = os.environ.get("GATEWAY_BIN", os.path.join(ROOT, ".build/debug/presence-gateway"))
        os.path.exists(self.binary) or fail(f"no gateway binary at {self.binary}: run swift build first")
        os.makedirs(self.arguments.screenshots, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix=f"presence-{name}-")
        self.prefix = f"{name}{os.getpid()}"
        self.nodes, self.drivers = [], []
        directory = os.path.join(ROOT, "Tests/Browser")
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=directory))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.page = f"http://127.0.0.1:{self.server.server_address[1]}/{page}"

    def node(self, name):
        node = Node(name, self.binary, self.redis_url, self.prefix, self.work)
        self.nodes.append(node)
        return node

    def browser(self, name):
        driver = browser(os.path.join(self.work, name))
        self.drivers.append(driver)
        return driver

    def stop(self):
        for driver in self.drivers:
            try:
                driver.quit()
            except Exception:  # noqa: BLE001
                pass
        for node in self.nodes:
            node.kill()
        self.server.shutdown()
        shutil.rmtree(self.work, ignore_errors=True)


@contextlib.contextmanager
def run_of(description, name, page):
    """A browser test's ``Run``, stopped however the test ends."""
    run = Run(description, name, page)
    try:
        yield run
    finally:
        run.stop()


def main():
    with run_of(__doc__.splitlines()[0], "browser", "app.html") as run:
        arguments, redis_url, prefix, app = run.arguments, run.redis_url, run.prefix, run.page
        a = run.node("node-a")
        b = run.node("node-b")
        request("PUT", f"{a.url}/api/admin/conversations/room", {"member_ids": ["alice", "bob"]})

        def page(user, peer, gateways):
            query = urllib.parse.urlencode({"gateways": ",".join(gateways), "token": token(user), "me": user, "peer": peer, "conversation": "room"})
            return f"{app}?{query}"

        bob = run.browser("bob")
        alice = run.browser("alice")
        board = run.browser("board")

        # 1. Bob's page first, then Alice's: her presence reaches him within 1 s of her page loading.
        bob.get(page("bob", "alice", [b.url, a.url]))
        wait_until(lambda: bob.find_element("id", "connection").text == "connected", 10, "Bob's page connected")
        alice.get(page("alice", "bob", [a.url, b.url]))
        loaded = alice.execute_script("return performance.timeOrigin + performance.timing.loadEventEnd - performance.timing.navigationStart")
        online = wait_until(lambda: next((e for e in peer_events(bob, "alice") if e["detail"]["status"] == "online"), None), 5, "Bob sees Alice online")
        seen_after = (online["at"] - loaded) / 1000
        check(seen_after < 1.0, f"Bob saw Alice online {seen_after:.3f} s after her page loaded (bound 1 s)")
        check(bob.find_element("id", "peer-status").text == "Online", "Bob's page shows \"Online\"")
        wait_until(lambda: alice.find_element("id", "connection").text == "connected", 5, "Alice's page connected")
        screenshot(alice, arguments.screenshots, "alice", ["me", "peer-status", "composer"])
        screenshot(bob, arguments.screenshots, "bob", ["me", "peer-status", "composer"])

        # 2. Alice's page hidden: away; shown again: online.
        started = time.time() * 1000
        alice.minimize_window()
        check(alice.execute_script("return document.visibilityState") == "hidden", "Alice's minimized page is hidden")
        wait_until(lambda: any(e["detail"]["status"] == "away" for e in peer_events(bob, "alice", started)), 3, "Bob sees Alice away")
        check(bob.find_element("id", "peer-status").text == "Away", "Bob's page shows \"Away\" while Alice's page is hidden")
        alice.maximize_window()
        wait_until(lambda: bob.find_element("id", "peer-status").text == "Online", 3, "Bob sees Alice online again when her page shows")
        check(True, "Alice's page shown again -> Bob sees \"Online\"")

        # 3. Typing in Alice's box, then nothing: Bob's indicator comes and goes 3 s after the last key.
        box = alice.find_element("id", "composer")
        for key in "hello":
            box.send_keys(key)
            time.sleep(0.2)
        last_key = time.time()
        wait_until(lambda: bob.find_element("id", "typing").text == "alice is typing…", 3, "Bob sees \"alice is typing…\"")
        check(True, "Bob's page shows \"alice is typing…\"")
        wait_until(lambda: bob.find_element("id", "typing").text == "", 6, "Alice's typing ends on Bob's page")
        gone_after = time.time() - last_key
        check(2.5 <= gone_after <= 4.5, f"the indicator went {gone_after:.2f} s after the last key (about 3 s)")

        # 4. The dashboard against presencectl.
        board.get(f"{b.url}/dashboard")
        board.find_element("id", "token-input").send_keys(ADMIN)
        board.find_element("css selector", "#token-form button[type=submit], #token-form button").click()
        wait_until(lambda: board.find_element("id", "feed-state").text.startswith("live"), 10, "the dashboard's feed is live")
        watch = subprocess.Popen([os.path.join(ROOT, ".build/debug/presencectl"), "watch", "--json", "--user", "alice", "--redis-url", redis_url,
                                  "--key-prefix", prefix], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # It says "watching" once subscribed (a fixed second was not always enough on a busy CI
        # machine: it missed the change).
        ready, _, _ = select.select([watch.stderr], [], [], 10)
        said = watch.stderr.readline() if ready else ""
        check(said.startswith("watching"), f"presencectl watch subscribed within 10 s ({said.strip()!r})")
        started = time.time() * 1000
        alice.minimize_window()
        wait_until(lambda: any(e["detail"]["status"] == "away" for e in peer_events(bob, "alice", started)), 3, "Bob sees Alice away again")
        wait_until(lambda: "away" in " ".join(li.text for li in board.find_elements("css selector", "#events li[data-user-id=alice]")), 5, "the dashboard's event tail has Alice away")
        # presencectl (a debug build, on a machine busy with three browsers) may print the change
        # a moment after the dashboard showed it: read until it has, then stop it.
        output = read_until(watch.stdout, lambda text: any(e.get("type") == "presence" and e.get("status") == "away" for e in json_values_so_far(text)), 5)
        watch.terminate()
        rest, errors = watch.communicate(timeout=5)
        output += rest
        watched = [event for event in json_values(output) if event.get("type") == "presence"]
        if not watched:
            print(f"e2e: presencectl watch printed nothing; its standard error: {errors.strip()!r}; exit {watch.returncode}")
        newest = board.find_elements("css selector", "#events li[data-user-id=alice]")[0].text
        check(watched and watched[-1]["status"] == "away" and "away" in newest and watched[-1]["at"][11:23] in newest,
              f"the dashboard's newest event for Alice ({newest!r}) is presencectl watch's ({watched[-1] if watched else None})")
        time.sleep(2.5)  # the next overview
        online_now = presencectl(["online"], redis_url, prefix)
        nodes_now = [n for n in presencectl(["nodes"], redis_url, prefix) if n["state"] == "live"]
        check(board.find_element("id", "count-online").text == str(online_now["online"]), f"online count {online_now['online']} as presencectl says")
        check(board.find_element("id", "count-away").text == str(online_now["away"]), f"away count {online_now['away']} as presencectl says")
        check(board.find_element("id", "count-nodes").text == str(len(nodes_now)), f"{len(nodes_now)} live nodes as presencectl says")
        shown_nodes = sorted(row.get_attribute("data-node-id") for row in board.find_elements("css selector", "#nodes tr[data-node-id]"))
        check(shown_nodes == sorted(n["node_id"] for n in nodes_now), f"the dashboard lists nodes {shown_nodes}")
        shown_users = sorted(row.get_attribute("data-user-id") for row in board.find_elements("css selector", "#users tr[data-user-id]"))
        check(shown_users == sorted(u["user_id"] for u in online_now["users"]), f"the dashboard lists users {shown_users} as presencectl does")
        board.find_element("id", "lookup-user").send_keys("alice")
        board.find_element("css selector", "#lookup-form button").click()
        device = wait_until(lambda: board.find_elements("css selector", "#lookup-result tr[data-device-id]"), 5, "the lookup shows Alice's device")[0]
        detail = presencectl(["user", "alice"], redis_url, prefix)
        check(device.get_attribute("data-device-id") == detail["devices"][0]["device_id"] and detail["devices"][0]["node"] in device.text
              and detail["devices"][0]["status"] in device.text, f"the lookup's device row ({device.text!r}) is presencectl user's")
        screenshot(board, arguments.screenshots, "dashboard", ["count-online", "nodes", "users", "events", "chart", "lookup-result"])
        alice.maximize_window()
        wait_until(lambda: bob.find_element("id", "peer-status").text == "Online", 3, "Alice online again")

        # 5. Node A killed: Alice's page moves to node B, and Bob never sees her offline.
        killed = time.time() * 1000
        a.kill()
        wait_until(lambda: [e for e in log_of(alice) if e["type"] == "connection" and e["detail"]["state"] == "connected" and e["at"] > killed], 10, "Alice's page reconnects")
        reconnected = next(e for e in log_of(alice) if e["type"] == "connection" and e["detail"]["state"] == "connected" and e["at"] > killed)
        check(True, f"Alice's page reconnected {(reconnected['at'] - killed) / 1000:.2f} s after node A was killed")
        time.sleep(LEASE + 3)  # past node A's lease and the reaper pass that would take its devices offline
        offline = [e for e in peer_events(bob, "alice", killed) if e["detail"]["status"] == "offline"]
        check(not offline, f"Bob never saw Alice offline across the node's death ({len(peer_events(bob, 'alice', killed))} events for her since)")
        check(bob.find_element("id", "peer-status").text == "Online", "Bob's page still shows Alice \"Online\"")

        # 6. Alice's tab closed: offline at once.
        app_tab = alice.current_window_handle
        alice.switch_to.new_window("tab")
        blank = alice.current_window_handle
        alice.switch_to.window(app_tab)
        closed = time.time() * 1000
        alice.close()
        alice.switch_to.window(blank)
        gone = wait_until(lambda: next((e for e in peer_events(bob, "alice", closed) if e["detail"]["status"] == "offline"), None), 3, "Bob sees Alice offline")
        check((gone["at"] - closed) / 1000 < 1.0, f"Bob saw Alice offline {(gone['at'] - closed) / 1000:.3f} s after her tab closed")
        print("e2e: all checks passed")


if __name__ == "__main__":
    main()
