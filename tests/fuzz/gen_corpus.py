#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer harnesses: tests/fuzz/corpus/<harness>/.

Small, structured starting points (one per op, per dtype x scale mode, per
.npy flavour) so that a short CI run begins from valid calls and mutates
them, plus the inputs of past findings as regression seeds. Deterministic:
rerunning rewrites the same files. Usage: tests/fuzz/gen_corpus.py
"""
import base64
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
rng = random.Random(20240601)


def write(harness, name, data):
    d = os.path.join(HERE, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(bytes(data))


def noise(n):
    return [rng.randrange(256) for _ in range(n)]


# fuzz_descriptor_validation: [op, flags, seed x4, dims x4, per tensor 9 bytes, ...]
# Slot bytes: template, ndim, dim indices, mutation (0 => kept: >= 9 leaves the
# template alone), value, capacities, cut, fill, NULL-descriptor marker.
OPS = ["quantize", "dequantize", "scale_layout_convert", "transpose_scaled", "convert_scaled",
       "transpose_scaled_grouped", "gemm", "linear_forward", "linear_dgrad", "linear_wgrad", "grouped_gemm",
       "grouped_gemm_wgrad", "moe_router", "moe_router_backward", "moe_permute", "moe_unpermute",
       "moe_unpermute_backward", "moe_swiglu", "moe_swiglu_backward", "context_create"]
# plausible templates per op (indices into the harness's template table)
TEMPL = {
    "quantize": [0, 3, 4], "dequantize": [3, 0], "scale_layout_convert": [3, 3 | 0x80],
    "transpose_scaled": [3, 4], "convert_scaled": [3, 7], "transpose_scaled_grouped": [3, 4],
    "gemm": [3, 9, 0], "linear_forward": [3, 9, 0], "linear_dgrad": [3, 4, 0], "linear_wgrad": [4, 4, 0],
    "grouped_gemm": [3, 9, 0], "grouped_gemm_wgrad": [4, 4, 0], "moe_router": [0, 12, 0, 13],
    "moe_router_backward": [0, 12, 0, 0], "moe_permute": [3, 12, 0, 3, 12, 12, 13, 0],
    "moe_unpermute": [0, 12, 0, 0], "moe_unpermute_backward": [0, 0, 12, 12, 0, 0, 0],
    "moe_swiglu": [0, 0, 3, 4], "moe_swiglu_backward": [0, 0, 0, 3, 4, 0], "context_create": [],
}
for op, name in enumerate(OPS):
    for variant in range(3):
        b = [op, 0x00 if variant == 0 else rng.randrange(256)]
        b += noise(4)
        b += [64, 128, 32, 2] if variant != 2 else [1, 33, 160 + rng.randrange(20), 0]
        for t in TEMPL[name]:
            # same dims for every tensor, no mutation, honest capacities, random fill
            b += [t, 0, 0b00011011 if variant else 0, 9 + variant, 0, 0x01, 0, 2, 0]
        b += [0] * 4          # no aliasing
        b += [0, 0, 3, 3, 0, 3, 0] + [1, 3, 64, 64, 2, 1, 1, 0]  # configs and splits
        b += noise(16 * variant)
        write("fuzz_descriptor_validation", f"{op:02d}-{name}-{variant}", b)
# Regression: the empty-tensor NULL + 0 offset (test_empty_tensors_accept_null_buffers).
write("fuzz_descriptor_validation", "regress-empty-null-scale",
      base64.b64decode("egHb+AAOPS4AKSkpKSnfYsUpKSkpKd9i"))

# fuzz_quantize_roundtrip: [in dtype|ndim, rows, cols, E, combos, outputs|layouts, rule, eps] + raw data
for combo in range(11):
    for k in range(2):
        hdr = [k % 3 | (0x80 if k else 0), 128 + rng.randrange(72) if k else 7, 8 + k, 1, combo | (rng.randrange(16) << 4),
               rng.randrange(256), rng.randrange(4), 1 if k else 0]
        data = []
        for _ in range(48):
            data += list(struct.pack("<f", rng.gauss(0, 1) * 2 ** rng.randrange(-20, 20)))
        if k:
            data[8:12] = list(struct.pack("<f", float("inf")))
            data[40:44] = list(struct.pack("<I", 0x7FC00001))
        write("fuzz_quantize_roundtrip", f"combo{combo:02d}-{k}", hdr + data)

# fuzz_requantize_oracle: [in combo, out combo, op|layouts|range, rule, rows, cols, E, seed] + codes, exponents
for ci in range(7):
    for co in range(7):
        if (ci >= 5 or co >= 5) and ci != co:
            continue
        hdr = [ci, co, rng.randrange(16), rng.randrange(3), rng.randrange(128, 256), rng.randrange(256),
               rng.randrange(256), rng.randrange(256)]
        write("fuzz_requantize_oracle", f"in{ci}-out{co}", hdr + noise(96))


# fuzz_npy_reader: well-formed files of every flavour the reader takes, and a few broken ones
def npy(descr, shape, payload, fortran=False, version=1):
    sh = "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
    h = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, "True" if fortran else "False", sh)
    pre = 10 if version == 1 else 12
    h += " " * ((64 - (pre + len(h) + 1) % 64) % 64) + "\n"
    if version == 1:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode() + payload
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<I", len(h)) + h.encode() + payload


write("fuzz_npy_reader", "f4-2x3", npy("<f4", [2, 3], struct.pack("<6f", *range(6))))
write("fuzz_npy_reader", "f2-4", npy("<f2", [4], struct.pack("<4e", 1, -2, 0.5, 65504)))
write("fuzz_npy_reader", "f8-fortran-2x3", npy("<f8", [2, 3], struct.pack("<6d", *range(6)), fortran=True))
write("fuzz_npy_reader", "bf16-V2-3x2x2", npy("<V2", [3, 2, 2], bytes(noise(24))))
write("fuzz_npy_reader", "bf16-name-v2", npy("bfloat16", [2, 2], bytes(noise(8)), version=2))
write("fuzz_npy_reader", "f4-v3-scalar", npy("<f4", [], struct.pack("<f", 3.5), version=3))
write("fuzz_npy_reader", "f4-empty", npy("<f4", [0, 5], b""))
write("fuzz_npy_reader", "truncated", npy("<f4", [4, 4], struct.pack("<3f", 1, 2, 3)))
write("fuzz_npy_reader", "big-endian", npy(">f4", [1], b"\x00\x00\x80\x3f"))
write("fuzz_npy_reader", "structured", b"\x93NUMPY\x01\x00\x40\x00" +
      b"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }".ljust(63) + b"\n")


# fuzz_moe_ops_oracle: [kind, T, k, E, H, pad|swiglu flags, flags, seed] + ids (T*k bytes) + probs, x, scales,
# y, dout, SwiGLU inputs (raw bytes, repeated by the harness). Appended last: the generator above stays as it was.
for kind in range(5):
    for v in range(3):
        T, k, E = [(7, 2, 4), (33, 8, 12), (1, 1, 1)][v]
        hdr = [kind, T - 1, k - 1, E - 1, [31, 99, 0][v], [0x01, 0x36, 0x2E][v] | (kind << 3 & 0x18),
               [0x07, 0x4B, 0xA9][v], rng.randrange(256)]
        ids = [rng.randrange(E + 1) for _ in range(T * k)]
        payload = []
        for _ in range(64):
            payload += list(struct.pack("<f", rng.gauss(0, 1)))
        payload[4:8] = list(struct.pack("<I", 0x7FC12345))  # a NaN with a payload
        payload[12:16] = list(struct.pack("<f", float("inf")))
        payload[20:24] = list(struct.pack("<f", 3e38))
        write("fuzz_moe_ops_oracle", f"kind{kind}-{v}", hdr + ids + payload)
# a routing that needs more rows than out has (spare rows taken away), and one with an id out of range
write("fuzz_moe_ops_oracle", "refuse-too-few-rows", [0, 9, 1, 2, 7, 0x06, 0x11, 6] + [1, 1, 1, 2, 1, 1, 1, 1, 1, 1] * 2)
write("fuzz_moe_ops_oracle", "refuse-id-out-of-range", [2, 5, 1, 3, 63, 0x02, 0x21, 1] + [0xFF, 1, 2, 3, 0xFF, 0] * 2)
