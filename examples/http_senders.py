"""Closed-loop HTTP senders against a running Tidemark, in the shape of the
peer comparison harness (issue 19): N senders, each its own process with a
keep-alive connection, each sending one message after another (waiting for
`send.ok`) into a direct conversation of its own. Python 3.8+, standard
library only.

Usage (a server started with `--no-rate-limits`, the admin token in
TIDEMARK_ADMIN_TOKEN, which is read from the environment, never argv):

    TIDEMARK_ADMIN_TOKEN=change-me python3 examples/http_senders.py \
        --url http://127.0.0.1:8080 --senders 8 --messages 1000 [--pid <serve's pid>]

It prints the accepted messages per second, and with --pid the CPU the
server's threads used during the send phase, per thread name (from
/proc/<pid>/task), so a reader can tell whose ceiling a figure is: the
server's single SQLite writer thread near one whole core means the writer
is the limit, not the client.
"""
import argparse
import http.client
import json
import multiprocessing
import os
import time
import urllib.parse
import uuid


def call(conn, path, body, token=None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    conn.request("POST", path, json.dumps(body), headers)
    resp = conn.getresponse()
    data = resp.read()
    reply = json.loads(data) if data else {}
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {reply.get('code')}")
    return reply


def connect(url):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)


def setup(url, admin, senders, run):
    """Creates 2 users per sender and their direct conversation; returns
    (sender token, conversation) pairs."""
    conn = connect(url)
    pairs = []
    for i in range(senders):
        a, b = f"hs{run}a{i}", f"hs{run}b{i}"
        for user in (a, b):
            call(conn, "/v1/admin/users", {"user": user, "password": "pw-" + user}, admin)
        token = call(conn, "/v1/login", {"user": a, "password": "pw-" + a, "device_id": "d1"})["access_token"]
        conv = call(conn, "/v1/rpc/conv.create", {"kind": "direct", "members": [b]}, token)["conv"]
        pairs.append((token, conv))
    conn.close()
    return pairs


def sender(args):
    url, token, conv, messages, start_at = args
    conn = connect(url)
    while time.time() < start_at:
        time.sleep(0.001)
    for n in range(messages):
        call(conn, "/v1/rpc/send",
             {"conv": conv, "client_msg_id": uuid.uuid4().hex, "content": {"text": f"m{n}"}}, token)
    conn.close()
    return messages


def thread_cpu(pid):
    """CPU seconds per thread name of a process, from /proc/<pid>/task."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--senders", type=int, default=8)
    p.add_argument("--messages", type=int, default=1000, help="messages in all, split over the senders")
    p.add_argument("--pid", type=int, help="the server's pid: report its threads' CPU")
    a = p.parse_args()
    admin = os.environ.get("TIDEMARK_ADMIN_TOKEN")
    if not admin:
        raise SystemExit("set TIDEMARK_ADMIN_TOKEN")
    pairs = setup(a.url, admin, a.senders, uuid.uuid4().hex[:6])
    each = max(1, a.messages // a.senders)
    start_at = time.time() + 0.5
    before = thread_cpu(a.pid) if a.pid else None
    with multiprocessing.Pool(a.senders) as pool:
        sent = sum(pool.map(sender, [(a.url, t, c, each, start_at) for t, c in pairs]))
    elapsed = time.time() - start_at
    print(f"{a.senders} senders: {sent} messages in {elapsed:.2f} s = {sent / elapsed:.0f} msgs/s")
    if before is not None:
        after = thread_cpu(a.pid)
        used = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        print(f"server CPU in the send phase: {sum(used.values()) / elapsed:.2f} cores")
        for name, cpu in sorted(used.items(), key=lambda kv: -kv[1])[:6]:
            print(f"  {name:<28} {cpu / elapsed:.2f} of a core")
        # The writer thread's name, as /proc shows it (15 bytes).
        writer = used.get("tidemark-sqlite", 0.0)
        if writer > 0:
            per_msg = writer / sent
            print(f"SQLite writer: {per_msg * 1000:.3f} ms of CPU per message, "
                  f"a ceiling of {1 / per_msg:.0f} msgs/s on one whole core")


if __name__ == "__main__":
    main()
