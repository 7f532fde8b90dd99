"""The fused log-probability statistics replayed on the host: src/cuda/logprobs/lp_fused_products.cu's
statistics epilogue and logprobs_kernels.cu's lp_fold_tiles_kernel, float32 where the kernels
compute in float32 (numpy scalars: one rounding an operation; fmaf as a float64 product rounded
once; 2^x rounded once where the SFU is approximate).

Per 192-wide tile, the four lanes of a quad (lane q holds columns 8 g + 2 q + {0, 1}): each lane's
state relative to its max, fmaf's residual folded out and the ties but one put back; the lanes
merged (0 with 1, 2 with 3, then the pairs); the tile's float4 partials; then the fold over tiles
(32 lanes, fixed order, double) and the merge's formulas. Compared with float64 on bf16 logits
(random, peaked, collapsed, tied and constant rows; V from 1 to 5000; three temperatures): lse,
the log-probability (relative to itself where the target is the max), the entropy, and the
distribution statistics (log sum p^2, the mean logit, is_top1 exactly).

Asks whether the arithmetic is right before a GPU runs it, so that a mismatch there lies in the
layout or the hardware, not in the formulas. Planted errors (the ties counted in full, r x 1.005,
the squares' ties dropped, max_before taking the target's column) fail it.

Run (CPU, about 1 s): python dev/lp_fused_emulate.py
"""

import math
import sys

import numpy as np

F32 = np.float32
LOG2E, LN2 = F32(1.4426950408889634), F32(0.6931471805599453)
TILE, QUAD = 192, 4


def fma32(a, b, c):
    return F32(np.float64(a) * np.float64(b) + np.float64(c))


def ex2(x):
    return F32(np.exp2(np.float64(x)))


def bf16(x):
    """x rounded to bfloat16 (to nearest even), as a float32."""
    bits = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def lane_state(xs, c):
    """(M, r, u, q) of one lane's columns (-inf: past V): M the raw max; r, u, q in base 2
    relative to M c exactly, one instance of M left out of r and q."""
    top = max((x for x in xs if not np.isnan(x)), default=F32(-np.inf))
    nan = any(np.isnan(x) for x in xs)
    r = u = q = F32(0)
    if top == np.inf:
        r = u = q = F32(np.nan)
    elif top != -np.inf:
        ym = F32(top * c)
        delta = fma32(top, c, -ym)
        rs = us = qs = ties = F32(0)
        for x in xs:
            d = fma32(x, c, -ym)
            is_top = x == top
            e = F32(0) if is_top else ex2(d)
            ties = F32(ties + (1 if is_top else 0))
            rs = F32(rs + e)
            us = fma32(e, max(d, F32(-256)), us)
            qs = fma32(e, e, qs)
        g = ex2(-delta)
        r = F32(F32(rs * g) + F32(ties - 1))
        u = F32(F32(us - F32(delta * rs)) * g)
        q = F32(F32(F32(qs * g) * g) + F32(ties - 1))
    if nan:
        r = u = q = F32(np.nan)
    return top, r, u, q


def merge_lanes(a, b, c):
    """Two lanes' (M, r, u, q), as lp_fused_products.cu's merge_lanes."""
    if b[0] == -np.inf:
        return a[0], F32(a[1] + b[1]), F32(a[2] + b[2]), F32(a[3] + b[3])
    if a[0] == -np.inf:
        return b[0], F32(b[1] + a[1]), F32(b[2] + a[2]), F32(b[3] + a[3])
    hi, lo = (a, b) if a[0] >= b[0] else (b, a)
    d = F32(F32(lo[0] - hi[0]) * c)
    f = ex2(d)
    one_r, one_q = F32(1 + lo[1]), F32(1 + lo[3])
    return (hi[0], F32(hi[1] + F32(one_r * f)), F32(hi[2] + F32(F32(lo[2] + F32(one_r * d)) * f)),
            F32(hi[3] + F32(F32(one_q * f) * f)))


def lp_merge(a, b):
    """logprob_math.h's lp_merge: a state in double with one in float (natural units)."""
    if b[0] == -np.inf:
        return a[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]
    if a[0] == -np.inf:
        return b[0], float(b[1]) + a[1], float(b[2]) + a[2], float(b[3]) + a[3]
    if a[0] < b[0]:
        a, b = (b[0], float(b[1]), float(b[2]), float(b[3])), a
    d = float(b[0]) - float(a[0])
    f = math.exp(d)
    return (a[0], a[1] + (1 + float(b[1])) * f, a[2] + (float(b[2]) + (1 + float(b[1])) * d) * f,
            a[3] + (1 + float(b[3])) * f * f)


def tile_partials(z, t, k, c, inv_t):
    """Tile k's two float4 partials of a row z (bf16 logits) with target t."""
    V = len(z)
    before = min(max(t - k * TILE, 0), TILE)
    states, sums, maxes = [], [], []
    for lane in range(QUAD):
        cols = [k * TILE + 8 * g + 2 * lane + v0 for g in range(TILE // 8) for v0 in range(2)]
        xs = [z[j] if j < V else F32(-np.inf) for j in cols]
        states.append(lane_state(xs, c))
        total, most = F32(0), F32(-np.inf)
        for j, x in zip(cols, xs):
            total = F32(total + (x if j < V else F32(0)))
            if j - k * TILE < before:
                most = max(most, x)
        sums.append(total)
        maxes.append(most)
    s = merge_lanes(merge_lanes(states[0], states[1], c), merge_lanes(states[2], states[3], c), c)
    x_sum = F32(F32(sums[0] + sums[1]) + F32(sums[2] + sums[3]))
    zt = z[t] if k * TILE <= t < (k + 1) * TILE else F32(0)
    first = (F32(s[0] * inv_t), s[1], F32(s[2] * LN2), F32(zt * inv_t))
    second = (s[3], F32(x_sum * inv_t), F32(max(maxes) * inv_t))
    return first, second


def fused_row(z, t, temperature):
    """lse, logprob, entropy, log sum p^2, mean logit, is_top1 of a row as the fused path forms them."""
    V = len(z)
    inv_t = F32(1 / temperature)
    c = F32(inv_t * LOG2E)
    parts = [tile_partials(z, t, k, c, inv_t) for k in range((V + TILE - 1) // TILE)]
    lanes = []
    for lane in range(32):
        st, x_sum, most = (-np.inf, 0.0, 0.0, 0.0), 0.0, -np.inf
        for first, second in parts[lane::32]:
            st = lp_merge(st, (first[0], first[1], first[2], second[0]))
            x_sum += float(second[1])
            most = max(most, second[2])
        lanes.append((st, x_sum, most))
    off = 16
    while off:
        lanes = [(lp_merge(lanes[i][0], lanes[i + off][0]), lanes[i][1] + lanes[i + off][1],
                  max(lanes[i][2], lanes[i + off][2])) if i + off < 32 else lanes[i] for i in range(32)]
        off //= 2
    (m, r, u, q), x_sum, most = lanes[0]
    m, r, u, q = F32(m), F32(r), F32(u), F32(q)
    zt = parts[t // TILE][0][3]
    l1 = math.log1p(float(r))
    return (float(m) + l1, (float(zt) - float(m)) - l1, l1 - float(u) / (1 + float(r)),
            math.log1p(float(q)) - 2 * l1, float(F32(x_sum)) / V, float(zt) >= float(m) and float(zt) > float(most))


def reference(z, t, temperature):
    """The same six in float64, relative to the row's first max (exact in collapse)."""
    zz = [float(x) / temperature for x in z]
    a = max(range(len(zz)), key=lambda j: (zz[j], -j))
    l1 = math.log1p(sum(math.exp(zz[j] - zz[a]) for j in range(len(zz)) if j != a))
    logp = [-l1 if j == a else (zz[j] - zz[a]) - l1 for j in range(len(zz))]
    return (zz[a] + l1, logp[t], -sum(math.exp(lp) * lp for lp in logp),
            math.log(sum(math.exp(2 * lp) for lp in logp)), sum(zz) / len(zz), a == t)


def row_of(kind, V, rng):
    z = rng.normal(0, 3, V)
    t = int(rng.integers(V))
    if kind == "peaked":
        z[t] = 30.0
    elif kind == "collapsed":
        z[:] = -120.0 - (np.arange(V) % 3)
        z[t] = 0.0
    elif kind == "tied":
        z[t] = z[(t * 7 + 3) % V] = 9.0
    elif kind == "constant":
        z[:] = 1.5
    return [bf16(x) for x in z], t


def close(got, want, temperature, z, t):
    """The C++ test's tolerances (tests/cpp/test_logprobs.cpp, LinearLogprobsCudaFused)."""
    zt, zmax = float(z[t]) / temperature, max(float(x) for x in z) / temperature
    scale = 1 + abs(want[0]) + abs(zt)
    zabs = max(abs(float(x)) for x in z) / temperature
    return (abs(got[0] - want[0]) <= 1e-6 * scale
            and abs(got[1] - want[1]) <= (0 if zt == zmax else 1e-6 * scale) + 2e-5 * abs(want[1]) + 1e-40
            and abs(got[2] - want[2]) <= 2e-5 * abs(want[2]) + 1e-7
            and abs(got[3] - want[3]) <= 2e-6 + 1e-6 * abs(want[3])
            and abs(got[4] - want[4]) <= 4e-7 * zabs + 1e-30
            and got[5] == want[5])


def main():
    rng = np.random.default_rng(0)
    rows = bad = 0
    for V in (1, 7, 191, 192, 193, 2001, 5000):
        for temperature in (1.0, 0.7, 1.3):
            for kind in ("randn", "peaked", "collapsed", "tied", "constant"):
                z, t = row_of(kind, V, rng)
                got, want = fused_row(z, t, temperature), reference(z, t, temperature)
                rows += 1
                if not close(got, want, temperature, z, t):
                    bad += 1
                    print(f"V={V} T={temperature} {kind}: got {got}, want {want}")
    print(f"{rows} rows, {bad} failing")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
