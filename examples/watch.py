"""Watch one device's sync log over the Tidemark WebSocket.

Usage: BOB=<access token> python3 examples/watch.py [ws://127.0.0.1:8080/v1/ws]

Python 3.8+ and nothing else (the WebSocket client below is the standard
library's asyncio streams). It authenticates with a first `auth` frame,
syncs whole batches (paging under the batch watermark), ACKs each batch
after "applying" it (printing), and syncs again whenever a hint arrives. A
hint carries no data: it only says the log grew.

Like a real device it keeps its local state, the generation and the last
applied `sync_seq`, in a file (`watch-<user>-<device>.json` in the current
directory), so the next run resumes where this one stopped. It handles
every answer a first page can get (docs/protocol.md §3.2):

- `sync.ok` at its own generation: apply, ACK;
- `sync.ok` with a *new* generation (a recovery session: the state file is
  a little behind the server's ACK, a restored backup): adopt the
  generation, apply the frozen range, ACK its watermark;
- `RESET_REQUIRED`: wipe the local state and rebuild under the error's
  generation, by a full replay, or, when the server refuses that (the log
  was trimmed by retention), by installing a snapshot (§3.24);
- `STALE_GENERATION` / `TOKEN_INVALID` on a next page or an ACK: the batch
  is void, start a new one; `UNAVAILABLE`: wait `retry_after_ms`, retry.
"""
import asyncio
import base64
import hashlib
import itertools
import json
import os
import struct
import sys
import urllib.parse

sys.stdout.reconfigure(line_buffering=True)  # lines show at once, even in a pipe

LIMIT = 50  # events per sync page
ATTEMPTS_MAX = 5  # refusals in a row before giving up


class WebSocket:
    """A minimal RFC 6455 client: text frames, ping/pong, close."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, url):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "ws":
            raise SystemExit(f"{url}: only ws:// is supported by this example")
        reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET {u.path or '/'} HTTP/1.1\r\nHost: {u.netloc}\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        if not head.startswith("HTTP/1.1 101"):
            raise SystemExit(f"upgrade refused: {head.splitlines()[0]}")
        return cls(reader, writer)

    def _frame(self, opcode, payload):
        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack("!Q", n)
        mask = os.urandom(4)
        self.writer.write(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    async def send(self, text):
        self._frame(0x1, text.encode())
        await self.writer.drain()

    async def recv(self):
        """The next text message; raises ConnectionError once closed."""
        message = b""
        while True:
            b0, b1 = await self.reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack("!H", await self.reader.readexactly(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", await self.reader.readexactly(8))[0]
            payload = await self.reader.readexactly(n)
            opcode = b0 & 0x0F
            if opcode == 0x8:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                raise ConnectionError(f"closed by the server ({code} {payload[2:].decode(errors='replace')})")
            if opcode == 0x9:
                self._frame(0xA, payload)
                await self.writer.drain()
            elif opcode in (0x0, 0x1, 0x2):
                message += payload
                if b0 & 0x80:
                    return message.decode()


class Refused(Exception):
    def __init__(self, frame):
        super().__init__(f"{frame['code']}: {frame['message']}")
        self.code, self.frame = frame["code"], frame


class Device:
    def __init__(self, ws):
        self.ws, self.rids, self.hinted = ws, itertools.count(1), False
        self.path, self.generation, self.applied = None, None, 0

    async def call(self, op, **body):
        """Sends one request and returns its reply; a hint or a kick that
        arrives in between is noted, never treated as data."""
        rid = str(next(self.rids))
        await self.ws.send(json.dumps({"t": op, "rid": rid, **body}))
        while True:
            frame = json.loads(await self.ws.recv())
            if frame.get("rid") == rid:
                if frame["t"] == "error":
                    raise Refused(frame)
                return frame
            self.note(frame)

    def note(self, frame):
        if frame.get("t") == "hint":
            print(f"hint: log reached {frame['user_sync_high_watermark']} ({frame['reason']})")
            self.hinted = True
        elif frame.get("t") == "kicked":
            raise SystemExit(f"kicked: {frame['reason']}")

    def load(self, user, device):
        self.path = f"watch-{user}-{device}.json"
        if os.path.exists(self.path):
            with open(self.path) as f:
                state = json.load(f)
            self.generation, self.applied = state["generation"], state["applied"]
            print(f"local state {self.path}: generation {self.generation}, applied {self.applied}")

    def save(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump({"generation": self.generation, "applied": self.applied}, f)
        os.replace(self.path + ".tmp", self.path)  # the position moves atomically

    def apply(self, e):
        m = e.get("message") or {}
        if e["kind"] == "message":
            what = f"{m['sender']} in {e['conv']} #{m['msg_seq']}: {m['content']}"
        elif m:
            what = f"{e['kind']} by {m['sender']} in {e['conv']} #{m['msg_seq']}: {m['content']}"
        else:
            what = f"{e['kind']} in {e['conv']}: {e.get('data')}"
        print(f"  sync_seq {e['sync_seq']}: {what}")

    async def sync_batch(self):
        """One whole batch, refusals included; returns once it is ACKed."""
        reset_to = None
        for _ in range(ATTEMPTS_MAX):
            try:
                return await (self.rebuild(reset_to) if reset_to is not None else self._batch())
            except Refused as r:
                reset_to = None
                if r.code == "RESET_REQUIRED":
                    reset_to = r.frame["sync_generation"]
                elif r.code in ("STALE_GENERATION", "TOKEN_INVALID"):
                    print(f"{r.code}: this batch is void; starting a new one")
                elif r.code == "UNAVAILABLE":
                    await asyncio.sleep(r.frame.get("retry_after_ms", 200) / 1000)
                else:
                    raise
        raise SystemExit(f"gave up after {ATTEMPTS_MAX} refusals in a row")

    async def _batch(self):
        first = {"limit": LIMIT, "local_applied_sync_seq": self.applied}
        if self.generation is not None:  # no local state: omit the generation
            first["sync_generation"] = self.generation
        page = await self.call("sync", **first)
        if page["sync_generation"] != self.generation and self.generation is not None:
            print(f"recovery: generation {page['sync_generation']}, replaying "
                  f"({page['resume_from']}, {page['batch_high_watermark']}] (server ACK {page['server_acked_sync_seq']})")
        self.generation, token = page["sync_generation"], page["batch_token"]
        while True:
            for e in page["events"]:
                if e["sync_seq"] > self.applied:  # a replay after a lost ACK is skipped
                    self.apply(e)
                    self.applied = e["sync_seq"]
            self.save()
            if not page["has_more"]:
                break
            page = await self.call("sync", batch_token=token, cursor=page["next_cursor"], limit=LIMIT)
        if page["batch_high_watermark"] > 0:
            ack = await self.call("ack", batch_token=token, sync_seq=page["batch_high_watermark"])
            print(f"  acked {ack['acked_sync_seq']} (generation {ack['sync_generation']})")

    async def rebuild(self, generation):
        """After RESET_REQUIRED: wipe, then a full replay or a snapshot."""
        print(f"RESET_REQUIRED: rebuilding under generation {generation}")
        self.generation, self.applied = generation, 0
        self.save()
        try:
            # A full replay works while the log was never trimmed.
            return await self._batch()
        except Refused as r:
            if r.code != "RESET_REQUIRED" or r.frame["sync_generation"] != generation:
                raise
        await self.install_snapshot()

    async def install_snapshot(self):
        begin = await self.call("snapshot.begin")
        items, digest = [], hashlib.sha256()
        for n in range(begin["pages"]):
            items += (await self.call("snapshot.page", snapshot_token=begin["snapshot_token"], page=n))["items"]
        for item in items:
            digest.update(json.dumps(item, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
            digest.update(b"\n")
        if digest.hexdigest() != begin["manifest_digest"]:
            raise SystemExit("snapshot digest mismatch: nothing installed")
        print(f"snapshot: base sync_seq {begin['base_sync_seq']}, {len(items)} item(s)")
        for item in items:
            if item["type"] == "message":
                m = item["message"]
                print(f"  {m['conv']} #{m['msg_seq']} {m['sender']}: {m['content']}")
        self.generation, self.applied = begin["sync_generation"], begin["base_sync_seq"]
        self.save()  # installed locally before the ack (§3.24 step 4)
        ack = await self.call("snapshot.ack", snapshot_token=begin["snapshot_token"])
        print(f"  snapshot acked at {ack['acked_sync_seq']} (generation {ack['sync_generation']})")
        await self._batch()


async def main():
    url = sys.argv[1] if len(sys.argv) > 1 else "ws://127.0.0.1:8080/v1/ws"
    device = Device(await WebSocket.connect(url))
    ok = await device.call("auth", token=os.environ["BOB"])
    print(f"authenticated as {ok['user']}, device {ok['device_id']}")
    device.load(ok["user"], ok["device_id"])
    await device.sync_batch()
    while True:
        device.note(json.loads(await device.ws.recv()))
        while device.hinted:
            device.hinted = False
            await device.sync_batch()


try:
    asyncio.run(main())
except (KeyboardInterrupt, ConnectionError, asyncio.IncompleteReadError) as e:
    print(f"stopped: {e or 'interrupted'}")
