"""Random KV event batches written byte by byte, in every form msgpack allows and some it
refuses: ints of every width, hashes as bin8/16/32 of 0-65 bytes, bad elements (nil, floats,
strings, nested values, ext) anywhere, array headers claiming more elements than follow, both
event forms (and a mix), map events with a field twice or in any order, unknown fields. What
`decode_batch` makes of each is what a reader in slices must make of it (the hunt of 7 Dec
2026 that found the tagged-map event read twice as `token_ids`)."""

from __future__ import annotations

import random
import struct


def array(n: int, rnd: random.Random) -> bytes:
    """An array header of `n` elements, in any form that can hold it."""
    form = rnd.choice(["fix", "16", "32"]) if n < 16 else rnd.choice(["16", "32"])
    if n >= 1 << 16:
        form = "32"
    if form == "fix":
        return bytes([0x90 | n])
    if form == "16":
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def text(value: str) -> bytes:
    data = value.encode()
    return (
        bytes([0xA0 | len(data)]) + data if len(data) < 32 else b"\xd9" + bytes([len(data)]) + data
    )


def an_int(rnd: random.Random) -> bytes:
    kind = rnd.randrange(12)
    if kind == 0:
        return bytes([rnd.randrange(0, 128)])
    if kind == 1:
        return bytes([rnd.randrange(0xE0, 0x100)])
    if kind == 10:  # (bytes that look like type bytes inside its value)
        return b"\xcf" + bytes([0xCE] * 8)
    if kind == 11:
        return b"\xce" + bytes([0xDD, 0xC4, 0x90, 0xC0])
    width = [1, 2, 4, 8][(kind - 2) % 4]
    return bytes([(0xCC if kind < 6 else 0xD0) + (kind - 2) % 4]) + rnd.randbytes(width)


def a_bin(rnd: random.Random, size: int | None = None) -> bytes:
    size = rnd.choice([0, 1, 31, 32, 33, 63, 64, 65]) if size is None else size
    data = bytes(
        rnd.choice([0xC4, 0xC5, 0xC6, 0xCE, 0xCF, 0x90, rnd.randrange(256)]) for _ in range(size)
    )
    kind = rnd.randrange(3)
    if kind == 0:
        return b"\xc4" + bytes([size]) + data
    if kind == 1:
        return b"\xc5" + size.to_bytes(2, "big") + data
    return b"\xc6" + size.to_bytes(4, "big") + data


def a_bad_element(rnd: random.Random) -> bytes:
    return rnd.choice(
        [
            b"\xc0",
            b"\xca" + struct.pack(">f", 1.0),
            b"\xcb" + struct.pack(">d", 2.0),
            text("abc"),
            b"\x91\x01",
            b"\xc3",
            b"\xd4\x01\x00",
            a_bin(rnd, 65),  # (a hash over `MAX_HASH_BYTES`)
            b"\x80",
            b"\xc1",  # (never used: malformed)
        ]
    )


def elements(rnd: random.Random, n: int, kind: str, p_bad: float) -> list[bytes]:
    out = []
    for _ in range(n):
        if rnd.random() < p_bad:
            out.append(a_bad_element(rnd))
        elif kind == "int" or rnd.random() < 0.5:
            out.append(an_int(rnd))
        else:
            out.append(a_bin(rnd, rnd.choice([0, 8, 32, 64])))
    return out


def array_of(rnd: random.Random, items: list[bytes]) -> bytes:
    """`items` as an array, its header sometimes claiming more than follow."""
    more = rnd.choice([1, 2, 5, 1000, 1 << 20]) if rnd.random() < 0.01 else 0
    return array(len(items) + more, rnd) + b"".join(items)


def unknown(rnd: random.Random) -> bytes:
    """A field no reader knows: anything, nested or not."""
    kind = rnd.randrange(5)
    if kind == 0:
        return array_of(rnd, elements(rnd, rnd.randrange(50), "int", 0))
    if kind == 1:
        return array(3, rnd) + b"\x90\x80" + array(2, rnd) + b"\x91\x90" + text("x")
    if kind == 2:
        return b"\x82" + text("a") + b"\x90" + text("b") + b"\x81\x01\x02"
    if kind == 3:
        return b"\xc5" + (300).to_bytes(2, "big") + rnd.randbytes(300)
    return rnd.choice([b"\xc0", b"\xc3", text("GPU")])


def an_event(rnd: random.Random, p_bad: float) -> bytes:
    """An event in the array form."""
    kind = rnd.randrange(10)
    n = rnd.randrange(200, 2000) if rnd.random() < 0.5 else rnd.randrange(0, 20)
    if kind < 6:
        hashes = array_of(rnd, elements(rnd, n // 8 + 1, "hash", p_bad))
        ids = array_of(rnd, elements(rnd, n, "int", p_bad))
        parent = rnd.choice([b"\xc0", an_int(rnd), a_bin(rnd, 32)])
        fields = [text("BlockStored"), hashes, parent, ids, an_int(rnd)]
        more = rnd.randrange(5)
        if more >= 1:
            fields.append(rnd.choice([b"\xc0", an_int(rnd)]))
        if more >= 2:
            fields.append(rnd.choice([b"\xc0", text("GPU")]))
        if more >= 3:
            fields.append(unknown(rnd))
        if rnd.random() < 0.05:
            fields.pop(rnd.randrange(1, len(fields)))  # (a field missing)
    elif kind < 9:
        fields = [text("BlockRemoved"), array_of(rnd, elements(rnd, n, "hash", p_bad))]
        if rnd.random() < 0.5:
            fields.append(rnd.choice([b"\xc0", text("GPU"), text("GPU"), an_int(rnd)]))
            if rnd.random() < 0.3:  # (where a `BlockStored` has its ids)
                fields.append(array_of(rnd, elements(rnd, n, "int", p_bad)))
    else:
        fields = [text("AllBlocksCleared")]
        if rnd.random() < 0.3:
            fields += [array_of(rnd, elements(rnd, n, "hash", 0)), unknown(rnd)]
    return array(len(fields), rnd) + b"".join(fields)


def a_map_event(rnd: random.Random, p_bad: float) -> bytes:
    """An event in the tagged-map form: its fields in any order, one of them twice at times."""
    kind = rnd.randrange(3)
    n = rnd.randrange(200, 2000) if rnd.random() < 0.5 else rnd.randrange(0, 20)
    if kind == 0:
        entries = [
            (text("type"), text("BlockStored")),
            (text("block_hashes"), array_of(rnd, elements(rnd, n // 8 + 1, "hash", p_bad))),
            (text("parent_block_hash"), rnd.choice([b"\xc0", a_bin(rnd, 32)])),
            (text("token_ids"), array_of(rnd, elements(rnd, n, "int", p_bad))),
            (text("block_size"), an_int(rnd)),
            (text("lora_id"), b"\xc0"),
            (text("medium"), text("GPU")),
            (text("lora_name"), b"\xc0"),
        ]
    elif kind == 1:
        entries = [
            (text("type"), text("BlockRemoved")),
            (text("block_hashes"), array_of(rnd, elements(rnd, n, "hash", p_bad))),
            (text("medium"), b"\xc0"),
        ]
    else:
        entries = [(text("type"), text("AllBlocksCleared"))]
    if rnd.random() < 0.3:  # (a field twice, either one bad at times)
        name = rnd.choice(["token_ids"] * 4 + ["block_hashes"] * 4 + ["type", "medium"])
        value = array_of(rnd, elements(rnd, n, "int", rnd.choice([0, 0.5])))
        entries.insert(rnd.randrange(len(entries) + 1), (text(name), value))
    if rnd.random() < 0.2:
        entries.append((text(rnd.choice(["unknown"] * 4 + ["token_ids"])), unknown(rnd)))
    if rnd.random() < 0.03:
        entries.append(
            (rnd.choice([b"\x91\x01", b"\x81\x01\x02", b"\x07"]), b"\xc0")
        )  # (not a str)
    if rnd.random() < 0.3:
        rnd.shuffle(entries)
    head = (
        bytes([0x80 | len(entries)])
        if len(entries) < 16
        else b"\xde" + len(entries).to_bytes(2, "big")
    )
    return head + b"".join(key + value for key, value in entries)


def a_batch(rnd: random.Random) -> bytes:
    """A batch of up to 12 events, mostly in one form."""
    p_bad = rnd.choice([0, 0, 0, 0.001, 0.01])
    mapped = rnd.random() < 0.3
    events = [
        (a_map_event if (mapped if rnd.random() > 0.02 else not mapped) else an_event)(rnd, p_bad)
        for _ in range(rnd.randrange(0, 12))
    ]
    ts = rnd.choice([b"\xcb" + struct.pack(">d", 1.5), b"\x05", b"\xca" + struct.pack(">f", 2.5)])
    fields = [ts, array_of(rnd, events)]
    if rnd.random() < 0.5:
        fields.append(rnd.choice([b"\xc0", b"\x00"]))
        if rnd.random() < 0.2:
            fields.append(unknown(rnd))
    return array(len(fields), rnd) + b"".join(fields)
