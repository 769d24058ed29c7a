"""NumPy reference of the operations (docs/reference.md, pinned details) and deterministic inputs that
every rank can regenerate for every other rank, so each rank checks its outputs on its own."""

import os

import numpy as np

import epx


# The seed of the seeded tests: EPX_TEST_SEED, else a random one that every failure message names.
SEED = int(os.environ.get("EPX_TEST_SEED", "0")) or int.from_bytes(os.urandom(2), "little")


def assert_equal(got, want, what, rank):
    """got and want (arrays or what np.asarray takes) have one shape and equal elements."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, "rank %d: %s shape %s, expected %s (seed %d)" % (
        rank, what, got.shape, want.shape, SEED)
    bad = np.argwhere(got != want)
    assert bad.size == 0, "rank %d: %s differs at %s: %s != %s (seed %d)" % (
        rank, what, bad[0].tolist(), got[tuple(bad[0])], want[tuple(bad[0])], SEED)


def bf16(a):
    """float32 values -> bf16 bit patterns (uint16)."""
    return epx.float32_to_bf16(np.asarray(a, dtype=np.float32))


def f32(a):
    """bf16 bit patterns -> float32."""
    return epx.bf16_to_float32(a)


class Problem:
    """Routing and data of every rank for one test, drawn from (seed, rank)."""

    def __init__(self, seed, nranks, max_tokens, hidden, topk, experts, ragged=True, idx_dtype=np.int64):
        self.seed, self.R, self.T_max = seed, nranks, max_tokens
        self.H, self.K, self.E = hidden, topk, experts
        self.L = experts // nranks
        self.tokens, self.x, self.topk_idx, self.weights, self.probs = [], [], [], [], []
        for s in range(nranks):
            rng = np.random.default_rng(seed * 1000 + s)
            T = int(rng.integers(0, max_tokens + 1)) if ragged else max_tokens
            idx = np.full((T, topk), -1, dtype=idx_dtype)
            for t in range(T):
                k = int(rng.integers(0, topk + 1))  # some tokens select fewer experts, or none
                idx[t, :k] = rng.choice(experts, size=k, replace=False)
                rng.shuffle(idx[t])
            # Small integers (and halves) are exact in bf16, so sums are checked bit for bit.
            x = bf16(rng.integers(-8, 9, size=(T, hidden)).astype(np.float32) / 2)
            w = (rng.integers(1, 5, size=(T, topk)) / 4).astype(np.float32)
            probs = np.zeros((T, experts), dtype=np.float32)
            for t in range(T):
                for k in range(topk):
                    if idx[t, k] >= 0:
                        probs[t, idx[t, k]] = w[t, k]
            self.tokens.append(T)
            self.x.append(x)
            self.topk_idx.append(idx)
            self.weights.append(w)
            self.probs.append(probs)

    def routing_map(self, s):
        return self.probs[s] != 0

    def experts_of(self, s, t):
        return [int(e) for e in self.topk_idx[s][t] if e >= 0]

    # ---------------------------------------------------------------- layout and HT

    def layout(self, s):
        T, R, L, E = self.tokens[s], self.R, self.L, self.E
        in_rank = np.zeros((T, R), dtype=bool)
        per_expert = np.zeros(E, dtype=np.int32)
        for t in range(T):
            for e in self.experts_of(s, t):
                in_rank[t, e // L] = True
                per_expert[e] += 1
        return in_rank.sum(axis=0).astype(np.int32), per_expert, in_rank

    def rank_prefix_matrix(self):
        """DeepEP's [R, R]: [s, d] = tokens ranks 0..s send rank d."""
        return np.cumsum(np.stack([self.layout(s)[0] for s in range(self.R)]), axis=0).astype(np.int32)

    def ht_rows(self, r):
        """(source rank, source token) of every row rank r receives, in HT order."""
        L = self.L
        return [(s, t) for s in range(self.R) for t in range(self.tokens[s])
                if any(e // L == r for e in self.experts_of(s, t))]

    def ht_dispatch(self, r, alignment=1):
        rows, L, K = self.ht_rows(r), self.L, self.K
        recv_x = np.zeros((len(rows), self.H), dtype=np.uint16)
        recv_idx = np.full((len(rows), K), -1, dtype=np.int64)
        recv_w = np.zeros((len(rows), K), dtype=np.float32)
        for i, (s, t) in enumerate(rows):
            recv_x[i] = self.x[s][t]
            for k in range(K):
                e = int(self.topk_idx[s][t, k])
                if e >= 0 and e // L == r:
                    recv_idx[i, k] = e - r * L
                    recv_w[i, k] = self.weights[s][t, k]
        counts = np.array([(recv_idx == j).any(axis=1).sum() for j in range(L)], dtype=np.int32)
        counts = ((counts + alignment - 1) // alignment * alignment).astype(np.int32)
        return recv_x, recv_idx, recv_w, counts

    @staticmethod
    def expert_fn(x_bf16, factor):
        """What the tests' "experts" do to a row: multiply by a small factor, rounded to bf16."""
        return bf16(f32(x_bf16) * np.float32(factor))

    def ht_combine(self, s, with_bias=False):
        """Rank r answers bf16(row * (r + 1)); sums ranks ascending, then bias0, bias1 (x and 2x)."""
        T, H = self.tokens[s], self.H
        out = np.zeros((T, H), dtype=np.float32)
        _, _, in_rank = self.layout(s)
        for r in range(self.R):
            part = f32(self.expert_fn(self.x[s], r + 1))
            out = np.where(in_rank[:, r:r + 1], out + part, out).astype(np.float32)
        if with_bias:
            out = (out + f32(self.x[s])).astype(np.float32)
            out = (out + f32(self.x[s]) * np.float32(2)).astype(np.float32)
        return bf16(out)

    # ---------------------------------------------------------------- LL

    def ll_dispatch(self, r):
        L, R, rows_cap = self.L, self.R, self.R * self.T_max
        recv_x = np.zeros((L, rows_cap, self.H), dtype=np.uint16)
        count = np.zeros(L, dtype=np.int32)
        src = np.zeros((L, rows_cap), dtype=np.int32)
        layout = np.zeros((L, R), dtype=np.int64)
        for j in range(L):
            e = r * L + j
            for s in range(R):
                begin = int(count[j])
                for t in range(self.tokens[s]):
                    if e in self.experts_of(s, t):
                        recv_x[j, count[j]] = self.x[s][t]
                        src[j, count[j]] = t
                        count[j] += 1
                n = int(count[j]) - begin
                layout[j, s] = (begin << 32) | n if n else 0
        return recv_x, count, src, layout

    def ll_fp8_rows(self, r):
        """(expert j, row i, source row v, scales) of every row rank r receives in LL: v as float32 in
        128-channel groups, its fp8 scales per the pinned cast, max(|v|) of each group / 448."""
        _, _, src, layout = self.ll_dispatch(r)
        for j in range(self.L):
            for s in range(self.R):
                begin, n = int(layout[j, s] >> 32), int(layout[j, s] & 0xFFFFFFFF)
                for i in range(begin, begin + n):
                    v = f32(self.x[s][src[j, i]]).reshape(self.H // 128, 128)
                    amax = np.maximum(np.abs(v).max(axis=1), np.float32(1e-4)).astype(np.float32)
                    yield j, i, v, (amax / np.float32(448)).astype(np.float32)

    def ll_combine(self, s):
        """Expert e answers bf16(row * (e % 3 + 1)); weighted sum over slots k ascending."""
        T, H = self.tokens[s], self.H
        out = np.zeros((T, H), dtype=np.float32)
        for t in range(T):
            acc = np.zeros(H, dtype=np.float32)
            for k in range(self.K):
                e = int(self.topk_idx[s][t, k])
                if e >= 0:
                    y = f32(self.expert_fn(self.x[s][t], e % 3 + 1))
                    acc = (acc + self.weights[s][t, k] * y).astype(np.float32)
            out[t] = acc
        return bf16(out)

    # ---------------------------------------------------------------- routing map

    def rm_dispatch(self, r, permute, pad):
        rows, L = self.ht_rows(r), self.L
        if not permute:
            tokens = np.array([self.x[s][t] for s, t in rows], dtype=np.uint16).reshape(len(rows), self.H)
            probs = np.array([self.probs[s][t, r * L:(r + 1) * L] for s, t in rows],
                             dtype=np.float32).reshape(len(rows), L)
            return tokens, probs, None, rows
        tokens, probs, per_expert, row_map = [], [], [], []
        for j in range(L):
            group = [(s, t) for s, t in rows if self.probs[s][t, r * L + j] != 0]
            padded = (len(group) + pad - 1) // pad * pad
            for s, t in group:
                tokens.append(self.x[s][t])
                probs.append(self.probs[s][t, r * L + j])
                row_map.append((s, t, j))
            for _ in range(padded - len(group)):
                tokens.append(np.zeros(self.H, dtype=np.uint16))
                probs.append(0.0)
                row_map.append(None)
            per_expert.append(padded)
        tokens = np.array(tokens, dtype=np.uint16).reshape(len(tokens), self.H)
        return tokens, np.array(probs, dtype=np.float32), np.array(per_expert, dtype=np.int32), row_map

    def rm_combine(self, s, permute, weighted):
        """Without permute rank r answers bf16(row * (r + 1)), summed over ranks; with permute expert
        (r, j) answers bf16(row * (j + 2)), summed ranks then experts ascending, times prob if weighted."""
        T, H, L = self.tokens[s], self.H, self.L
        out = np.zeros((T, H), dtype=np.float32)
        for t in range(T):
            acc = np.zeros(H, dtype=np.float32)
            for r in range(self.R):
                local = [e - r * L for e in sorted(self.experts_of(s, t)) if e // L == r]
                if not local:
                    continue
                if not permute:
                    acc = (acc + f32(self.expert_fn(self.x[s][t], r + 1))).astype(np.float32)
                    continue
                for j in local:
                    y = f32(self.expert_fn(self.x[s][t], j + 2))
                    w = self.probs[s][t, r * L + j]
                    acc = (acc + (w * y if weighted else y)).astype(np.float32)
            out[t] = acc
        return bf16(out)
