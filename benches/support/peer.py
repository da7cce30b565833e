#!/usr/bin/env python3
"""The Python asyncio peer of `imgpipe run`, for `cargo bench --bench cpu`.

A small client that does per call what imgpipe's run does, against the same sandbox, so that
the CPU each spends can be compared: a row in a SQLite file (WAL, synchronous=FULL) committed
before the paid call; the call (X-API-Key); a row committed after it naming the job; the result
URL downloaded, hashed (sha256), written to a temporary file in the item's directory (made
with its first output, as imgpipe lays a run out), fsynced, linked into place without
replacing anything, its directory fsynced; and the output recorded, committed. Calls run with
bounded concurrency (imgpipe's default, 4) and no rate limit.

Usage: peer.py BASE_URL API_KEY ITEMS OUT_DIR [CONCURRENCY]
The key comes in argv only because the sandbox's key is a throwaway; the peer never prints it.
Prints one JSON line: calls made, outputs kept, wall seconds.
"""

import asyncio
import concurrent.futures
import hashlib
import json
import os
import sqlite3
import sys
import time

try:
    import aiohttp
except ImportError:
    sys.exit("peer.py needs aiohttp: apt-get install python3-aiohttp (or pip install aiohttp)")

SAMPLES = ["mug", "lamp", "chair", "plant"]


class Record:
    """The SQLite record, written on one thread of its own (one connection, as imgpipe has)."""

    def __init__(self, path):
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.db = None
        self.pool.submit(self._open, path).result()

    def _open(self, path):
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = FULL")
        self.db.executescript(
            """
            CREATE TABLE IF NOT EXISTS calls (
                task TEXT PRIMARY KEY, state TEXT NOT NULL, started_at INTEGER NOT NULL,
                job_id TEXT, credits INTEGER, ended_at INTEGER);
            CREATE TABLE IF NOT EXISTS outputs (
                task TEXT PRIMARY KEY, path TEXT NOT NULL, sha256 TEXT NOT NULL,
                bytes INTEGER NOT NULL);
            """
        )

    def _commit(self, sql, args):
        self.db.execute("BEGIN")
        self.db.execute(sql, args)
        self.db.execute("COMMIT")

    async def write(self, sql, *args):
        await asyncio.get_running_loop().run_in_executor(self.pool, self._commit, sql, args)


def keep(path, body):
    """Writes body to a temporary file beside path, fsyncs it, links it in without replacing
    anything, and fsyncs the directory."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = path + ".part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.link(part, path)
    os.unlink(part)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


async def one(i, session, api, key, record, out, files):
    task = f"item-{i:05}/edit"
    url = f"https://sandbox.invalid/assets/{SAMPLES[i % len(SAMPLES)]}.png"
    await record.write(
        "INSERT INTO calls (task, state, started_at) VALUES (?, 'sent', ?)",
        task,
        time.time_ns() // 1_000_000,
    )
    body = {"image_url": url, "object_name": f"item-{i:05}"}
    async with session.post(
        api + "v1/images/tools/erase", json=body, headers={"X-API-Key": key}
    ) as r:
        r.raise_for_status()
        job = await r.json()
    await record.write(
        "UPDATE calls SET state = 'succeeded', job_id = ?, credits = ?, ended_at = ? WHERE task = ?",
        job["id"],
        job["credits_used"],
        time.time_ns() // 1_000_000,
        task,
    )
    async with session.get(job["data"]["url"]) as r:
        r.raise_for_status()
        image = await r.read()
    digest = hashlib.sha256(image).hexdigest()
    # imgpipe's layout: a directory per item, made with its first output.
    path = os.path.join(out, f"item-{i:05}", "edit.png")
    await asyncio.get_running_loop().run_in_executor(files, keep, path, image)
    await record.write(
        "INSERT INTO outputs (task, path, sha256, bytes) VALUES (?, ?, ?, ?)",
        task,
        path,
        digest,
        len(image),
    )


async def main(api, key, items, out, concurrency):
    os.makedirs(out, exist_ok=True)
    record = Record(os.path.join(out, "peer.db"))
    files = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency)
    gate = asyncio.Semaphore(concurrency)
    start = time.monotonic()

    async def bounded(i, session):
        async with gate:
            await one(i, session, api, key, record, out, files)

    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(bounded(i, session) for i in range(items)))
    kept = sum(1 for n in os.listdir(out) if os.path.isfile(os.path.join(out, n, "edit.png")))
    print(json.dumps({"calls": items, "outputs": kept, "wall": time.monotonic() - start}))


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    base, api_key, n, out_dir = sys.argv[1:5]
    limit = int(sys.argv[5]) if len(sys.argv) == 6 else 4
    asyncio.run(main(base if base.endswith("/") else base + "/", api_key, int(n), out_dir, limit))
