"""Watch one device's sync log over the Tidemark WebSocket.

Usage: BOB=<access token> python3 examples/watch.py [ws://127.0.0.1:8080/v1/ws]
Needs `pip install websockets`. It authenticates with a first `auth` frame,
syncs whole batches (paging under the batch watermark), ACKs each batch
after "applying" it (printing), and syncs again whenever a hint arrives.
A hint carries no data: it only says the log grew.
"""
import asyncio
import itertools
import json
import os
import sys

import websockets

rids = itertools.count(1)


async def call(ws, op, **body):
    """Sends one request and returns its reply; a hint that arrives in
    between is remembered, never treated as data."""
    rid = str(next(rids))
    await ws.send(json.dumps({"t": op, "rid": rid, **body}))
    while True:
        frame = json.loads(await ws.recv())
        if frame.get("rid") == rid:
            if frame["t"] == "error":
                raise RuntimeError(f"{frame['code']}: {frame['message']}")
            return frame
        if frame.get("t") == "hint":
            call.hinted = True


async def sync_batch(ws, state):
    page = await call(ws, "sync", sync_generation=state["generation"],
                      local_applied_sync_seq=state["applied"], limit=50)
    state["generation"] = page["sync_generation"]
    token = page["batch_token"]
    while True:
        for e in page["events"]:
            if e["sync_seq"] > state["applied"]:  # a replay after a lost ACK is skipped
                m = e["message"]
                print(f"  sync_seq {e['sync_seq']}: {m['sender']} in {e['conv']} #{m['msg_seq']}: {m['content']}")
                state["applied"] = e["sync_seq"]
        if not page["has_more"]:
            break
        page = await call(ws, "sync", batch_token=token, cursor=page["next_cursor"], limit=50)
    if page["batch_high_watermark"] > 0:
        ack = await call(ws, "ack", batch_token=token, sync_seq=page["batch_high_watermark"])
        print(f"  acked {ack['acked_sync_seq']} (generation {ack['sync_generation']})")


async def main():
    url = sys.argv[1] if len(sys.argv) > 1 else "ws://127.0.0.1:8080/v1/ws"
    state = {"generation": None, "applied": 0}
    async with websockets.connect(url) as ws:
        print(await call(ws, "auth", token=os.environ["BOB"]))
        await sync_batch(ws, state)
        async for frame in ws:
            frame = json.loads(frame)
            if frame.get("t") == "hint":
                print(f"hint: log reached {frame['user_sync_high_watermark']} ({frame['reason']})")
                call.hinted = True
                while call.hinted:
                    call.hinted = False
                    await sync_batch(ws, state)


call.hinted = False
asyncio.run(main())
