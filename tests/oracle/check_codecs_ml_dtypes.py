#!/usr/bin/env python3
"""Independent oracle: the C codecs of format.h against ml_dtypes / numpy casts.

Usage: check_codecs_ml_dtypes.py FM_CODEC_DUMP PYDEPS_DIR ENABLED

Installs numpy and ml_dtypes from PyPI into PYDEPS_DIR (once) and exits 77
(meson SKIP) when that is impossible (offline) or ENABLED is 0
(-Doracle_tests=false). Inputs: all 2^16 BF16 bit patterns as F32, plus a few
million random F32 bit patterns (raw, and concentrated in the FP8/FP4/F16
ranges). The seed is printed; FM_TEST_SEED replays it.

Where ml_dtypes and flowmoe's rules legitimately differ, the comparison is
restricted, and each restriction is checked separately:
  * Saturation. flowmoe's FP8/FP4 casts are satfinite (cvt.rn.satfinite);
    ml_dtypes float8_e4m3fn overflows to NaN and float8_e5m2 to Inf. Exact
    comparison is done where ml_dtypes' result is finite (ties at the top
    binade's midpoint included); where it is not (|x| beyond the rounding
    range, or x = +-Inf) flowmoe must give +-max (0x7E / 0x7B with the sign).
  * E2M1 has no NaN: ml_dtypes gives 0 for NaN, format.h specifies 0x7.
    NaN inputs are excluded from the E2M1 comparison and checked for 0x7.
  * NaN encodings. ml_dtypes keeps the NaN's sign/payload; format.h specifies
    one code per format (E4M3 0x7F, E5M2 0x7E, BF16 0x7FC0, F16 0x7E00).
    NaN inputs are compared for NaN-ness with ml_dtypes and for the exact
    code against format.h.
  * BF16 and F16 follow IEEE RNE with overflow to Inf in both, so everything
    but NaN is compared bit for bit.
"""
import os
import subprocess
import sys
import tempfile
import time


def skip(msg):
    print("SKIP: " + msg)
    sys.exit(77)


def main():
    if len(sys.argv) != 4:
        print(__doc__)
        return 2
    dump, pydeps, enabled = sys.argv[1], sys.argv[2], sys.argv[3]
    if enabled != "1":
        skip("oracle_tests=false")
    sys.path.insert(0, pydeps)
    try:
        import numpy as np  # noqa: F401
        import ml_dtypes  # noqa: F401
    except ImportError:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--target", pydeps, "numpy", "ml_dtypes"], capture_output=True, text=True)
        if r.returncode != 0:
            skip("cannot install numpy + ml_dtypes from PyPI:\n" + r.stderr[-2000:])
        import importlib
        importlib.invalidate_caches()
        try:
            import numpy as np  # noqa: F401
            import ml_dtypes  # noqa: F401
        except ImportError as e:
            skip("numpy / ml_dtypes installed but not importable: %s" % e)
    import numpy as np
    import ml_dtypes

    seed = int(os.environ.get("FM_TEST_SEED", str(time.time_ns() % (1 << 63))))
    print("check_codecs_ml_dtypes: seed %d (replay with FM_TEST_SEED=%d), numpy %s, ml_dtypes %s"
          % (seed, seed, np.__version__, ml_dtypes.__version__))
    rng = np.random.default_rng(seed)

    bf16_all = (np.arange(1 << 16, dtype=np.uint32) << 16)
    raw = rng.integers(0, 1 << 32, size=1_500_000, dtype=np.uint64).astype(np.uint32)
    # exponents where FP8 / FP4 / F16 rounding decisions happen
    mant_sign = rng.integers(0, 1 << 32, size=1_500_000, dtype=np.uint64).astype(np.uint32) & np.uint32(0x807FFFFF)
    exps = rng.integers(127 - 30, 127 + 18, size=1_500_000).astype(np.uint32) << 23
    near = mant_sign | exps
    # F32 subnormals and the specials
    sub = rng.integers(0, 1 << 23, size=100_000, dtype=np.uint64).astype(np.uint32)
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                         0xFFFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001], dtype=np.uint32)
    bits = np.concatenate([bf16_all, raw, near, sub, sub | np.uint32(0x80000000), specials])
    x = bits.view(np.float32)

    with tempfile.TemporaryDirectory() as td:
        fin, fout = os.path.join(td, "in.bin"), os.path.join(td, "out.bin")
        bits.astype("<u4").tofile(fin)
        r = subprocess.run([dump, fin, fout])
        if r.returncode != 0:
            print("FAIL: fm-codec-dump exited %d" % r.returncode)
            return 1
        rec = np.fromfile(fout, dtype=np.uint8).reshape(-1, 7)
    if rec.shape[0] != bits.shape[0]:
        print("FAIL: %d records for %d inputs" % (rec.shape[0], bits.shape[0]))
        return 1
    got = {
        "e4m3": rec[:, 0], "e5m2": rec[:, 1], "e2m1": rec[:, 2],
        "bf16": rec[:, 3].astype(np.uint16) | (rec[:, 4].astype(np.uint16) << 8),
        "f16": rec[:, 5].astype(np.uint16) | (rec[:, 6].astype(np.uint16) << 8),
    }
    isnan = np.isnan(x)
    neg = np.signbit(x)
    failures = 0
    checks = 0

    def report(name, scope, bad, want):
        nonlocal failures, checks
        mask = scope & bad
        idx = np.nonzero(mask)[0]
        checks += 1
        if idx.size:
            failures += 1
            print("FAIL %s: %d inputs differ, e.g.:" % (name, idx.size))
            for i in idx[:10]:
                print("   x=%r (bits 0x%08x): flowmoe 0x%x, want 0x%x" % (float(x[i]), int(bits[i]), int(got[name.split()[0]][i]), int(want[i])))
        else:
            print("ok   %s (%d inputs)" % (name, int(np.count_nonzero(scope))))

    with np.errstate(over="ignore", invalid="ignore"):
        for name, dt, maxcode, nancode in (("e4m3", ml_dtypes.float8_e4m3fn, 0x7E, 0x7F),
                                           ("e5m2", ml_dtypes.float8_e5m2, 0x7B, 0x7E)):
            y = x.astype(dt)
            yv = y.astype(np.float32)
            want = y.view(np.uint8)
            finite = np.isfinite(yv) & np.isfinite(x)
            report(name + " (finite results, exact)", finite, got[name] != want, want)
            over = ~np.isfinite(yv) & ~isnan
            sat = (maxcode | (neg.astype(np.uint8) << 7)).astype(np.uint8)
            report(name + " (overflow saturates to +-max)", over, got[name] != sat, sat)
            report(name + " (NaN code)", isnan, got[name] != nancode, np.full_like(want, nancode))
            report(name + " (ml_dtypes agrees NaN in = NaN out)", isnan, ~np.isnan(yv), want)

        y = x.astype(ml_dtypes.float4_e2m1fn)
        want = y.view(np.uint8) & 0xF
        report("e2m1 (non-NaN inputs, exact; ml_dtypes saturates too)", ~isnan, got["e2m1"] != want, want)
        report("e2m1 (NaN -> 0x7 per format.h)", isnan, got["e2m1"] != 7, np.full_like(want, 7))

        for name, dt, canon in (("bf16", ml_dtypes.bfloat16, 0x7FC0), ("f16", np.float16, 0x7E00)):
            y = x.astype(dt)
            want = y.view(np.uint16)
            report(name + " (non-NaN, exact incl. overflow to Inf)", ~isnan, got[name] != want, want)
            report(name + " (NaN -> canonical)", isnan, got[name] != canon, np.full_like(want, canon))
            report(name + " (ml_dtypes agrees NaN)", isnan, ~np.isnan(y.astype(np.float32)), want)

    print("%d inputs, %d passed, %d failed" % (bits.size, checks - failures, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
