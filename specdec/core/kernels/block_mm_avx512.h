// The AVX-512 tile of block_mm.cpp (see its header), included there once per instruction set inside a namespace of
// its own (avx512, vnni), where the including file defines SPECDEC_TARGET (the functions' target attribute),
// SPECDEC_VNNI (1: the integer dot products with AVX512-VNNI's vpdpbusd / vpdpwssd, 4 or 2 products a lane an
// instruction summed in 32 bits; 0: vpmaddubsw, vpmaddwd and 32-bit adds). Both compute the same exact integer
// dots, so both paths give the same bits.

// The vectors of a u-kind group's unpacked codes: G / 4 (u6: G = 16; u4, u5: G = 32)
template <Kind KIND>
constexpr int NVEC = KIND == U6 ? 4 : 8;

// Group tg's codes (u4 / u5 / u6, + offset, in [0, 63]) as NVEC = G / 4 vectors: vector i, lane j holds the codes of
// k = 4i .. 4i + 3 of column j (vpdpbusd's operand).
template <Kind KIND>
SPECDEC_TARGET inline void unpack(const uint8_t* tg, __m512i* q) {
  const __m512i low4 = _mm512_set1_epi8(15);
  if constexpr (KIND == U4) {     // vector v of 64 bytes: k = 8v + i in the low nibbles, 8v + 4 + i in the high
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m512i b = _mm512_loadu_si512(tg + 64 * v);
      q[2 * v] = _mm512_and_si512(b, low4);
      q[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    }
  } else {
    constexpr int NV = NVEC<KIND>;
    // c[4v + i] = low nibble | high bits << 4: the high bits of vector v sit at bit HB·v of the last vector
    constexpr int HB = KIND == U6 ? 2 : 1;
    const __m512i h = _mm512_loadu_si512(tg + 64 * (NV / 2)), high = _mm512_set1_epi8(((1 << HB) - 1) << 4);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m512i l = _mm512_loadu_si512(tg + 64 * (v / 2));
      const __m512i lo = _mm512_and_si512(v % 2 ? _mm512_srli_epi16(l, 4) : l, low4);
      const int shift = 4 - HB * v;    // moves bit HB·v to bit 4
      const __m512i hi = shift >= 0 ? _mm512_slli_epi16(h, shift) : _mm512_srli_epi16(h, -shift);
      q[v] = _mm512_or_si512(lo, _mm512_and_si512(hi, high));
    }
  }
}

// a group's 16 int8 scales (or mins), widened to 32 bits
SPECDEC_TARGET inline __m512i group_scales(const int8_t* sc) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
}

// Σ_k (code + offset) · xq over one group of a u-kind for one row's activations xr, per lane (exact). VNNI: four
// independent vpdpbusd chains summed at the end (the integer sum is the same in any order), so a group's dot waits
// on two multiply-add latencies, not NV, and more groups overlap in the out-of-order window.
template <int NV>
SPECDEC_TARGET inline __m512i dot_codes(const __m512i* q, const int8_t* xr) {
#if SPECDEC_VNNI
  __m512i part[4];
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) part[v] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[v], bcast32(xr + 4 * v));
#pragma GCC unroll 4
  for (int v = 4; v < NV; ++v) part[v % 4] = _mm512_dpbusd_epi32(part[v % 4], q[v], bcast32(xr + 4 * v));
  return _mm512_add_epi32(_mm512_add_epi32(part[0], part[1]), _mm512_add_epi32(part[2], part[3]));
#else
  __m512i dot = _mm512_setzero_si512();
  const __m512i ones16 = _mm512_set1_epi16(1);
#pragma GCC unroll 4
  for (int v = 0; v < NV; v += 2) {   // two products of a pair: ≤ 2 · 2 · 63 · 127 < 2^15 in 16 bits
    const __m512i s16 = _mm512_add_epi16(_mm512_maddubs_epi16(q[v], bcast32(xr + 4 * v)),
                                         _mm512_maddubs_epi16(q[v + 1], bcast32(xr + 4 * v + 4)));
    dot = _mm512_add_epi32(dot, _mm512_madd_epi16(s16, ones16));
  }
  return dot;
#endif
}

#if SPECDEC_VNNI
// Q4_K (u4 codes in [0, 15], superblocks of 8 groups): isum + sc · Σ code · xq over one group for one row, in two
// vpdpbusd chains of 16 products a lane (|chain| ≤ 16 · 15 · 127 < 2^15: exact in its low 16 bits), each multiplied by
// the group scale in one vpdpwssd (sc16: each lane's sc in its low 16 bits, 0 in the high ones) — 10 instructions a row
// and group, where the four-chain dot, its adds and vpmulld took 14; the integer sum is the same.
SPECDEC_TARGET inline __m512i add_scaled_u4(__m512i isum, const __m512i* q, const int8_t* xr, __m512i sc16) {
  __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], bcast32(xr));
  __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[1], bcast32(xr + 4));
#pragma GCC unroll 3
  for (int v = 2; v < 8; v += 2) {
    even = _mm512_dpbusd_epi32(even, q[v], bcast32(xr + 4 * v));
    odd = _mm512_dpbusd_epi32(odd, q[v + 1], bcast32(xr + 4 * v + 4));
  }
  return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum, even, sc16), odd, sc16);
}
#endif

// Tile t, rows r0 .. r0 + R: every group's codes unpacked once, applied to the R rows; per superblock, each row's
// integer sums (isum, msum) then its f32 steps (apply_scales). SUPER: superblocks of several groups (K-quants); else
// one group a superblock, whose scale and min are d and dmin themselves (sc = mn = 1: not read). The stream's
// pointers advance group by group and the layer's flags are read once, so a group's loop is its loads, unpacking
// and multiply-adds.
template <int R, Kind KIND, bool SUPER>
SPECDEC_TARGET void tile(const Args& p, int64_t t, int64_t r0) {
  const int64_t ng = p.groups(), per = SUPER ? p.per() : 1, nsb = p.K / p.SB, K = p.K, G = p.G;
  // a group's bytes: for the u-kinds a constant (G = 4 · NVEC; the prefetch loop unrolls), for s8 G · 16
  const int64_t gb = KIND == S8 ? p.group_bytes() : LANES * 4 * NVEC<KIND> * Args::bits(KIND) / 8;
  const int64_t prefetch = p.prefetch;
  const bool offset = p.offset != 0, mins = p.mins;
  constexpr int NV = NVEC<KIND>;
  // 16-bit element 2j ← element j, 2j + 1 ← element 16 + j: two groups' mins of lane j side by side
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* tg = p.qs + t * ng * gb;              // group g's bytes
  const int8_t* x0 = p.xq + r0 * K;                     // row r0's activations (row r: + r · K)
  const int32_t* osx = offset ? p.osx + r0 * ng : nullptr;   // row r0's offset · sx of group g (row r: + r · ng)
  const at::Half* dp = p.d + t * nsb * LANES;
  const at::Half* mp = p.dmin + t * nsb * LANES;
  const float* dx = p.dx + r0 * nsb;                    // row r0's superblock scale (row r: + r · nsb)
  for (int64_t s = 0; s < nsb; ++s, dp += LANES, mp += LANES, ++dx) {
    const int64_t g0 = s * per;
    const __m512 a = load_f16(dp);
    const __m512 b = mins ? _mm512_sub_ps(_mm512_setzero_ps(), load_f16(mp)) : _mm512_setzero_ps();
    __m512i isum[R];
    if constexpr (SUPER)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int64_t gi = 0, k = g0 * G; gi < per; ++gi, tg += gb, k += G) {
      if (prefetch)     // this group's bytes a few KB ahead of the stream, into L2 (see block_mm.cpp)
        for (int64_t c = 0; c < gb; c += 64) _mm_prefetch(reinterpret_cast<const char*>(tg + prefetch + c), _MM_HINT_T1);
      const __m512i sc32 = SUPER ? group_scales(p.sc + (t * ng + g0 + gi) * LANES) : _mm512_setzero_si512();
      if constexpr (KIND != S8) {
        __m512i q[NV];
        unpack<KIND>(tg, q);
#if SPECDEC_VNNI
        if constexpr (SUPER && KIND == U4) {
          const __m512i sc16 = _mm512_and_si512(sc32, _mm512_set1_epi32(0xFFFF));
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) isum[r] = add_scaled_u4(isum[r], q, x0 + r * K + k, sc16);
          continue;
        }
#endif
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          __m512i dot = dot_codes<NV>(q, x0 + r * K + k);
          if (offset)     // codes stored + offset: dot − offset · sx, from memory
            dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(osx[r * ng + g0 + gi]));
          isum[r] = add_scaled<SUPER>(isum[r], dot, sc32);
        }
      } else {
        // signed codes: widened to 16 bits, vpmaddwd with the activations' pairs
        const int64_t nv = G / 2;     // 8 or 16 vectors of 16 lanes × 2 codes
        __m512i q[16];
#pragma GCC unroll 16
        for (int v = 0; v < 16; ++v)
          if (v < nv) q[v] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 32 * v)));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const int16_t* xr = p.xw + (r0 + r) * K + k;
          __m512i dot = _mm512_setzero_si512();
#pragma GCC unroll 16
          for (int v = 0; v < 16; ++v) {
            if (v >= nv) break;
#if SPECDEC_VNNI
            dot = _mm512_dpwssd_epi32(dot, q[v], bcast32(xr + 2 * v));   // (x[2v], x[2v+1]) in 16 bits
#else
            dot = _mm512_add_epi32(dot, _mm512_madd_epi16(q[v], bcast32(xr + 2 * v)));
#endif
          }
          isum[r] = add_scaled<SUPER>(isum[r], dot, sc32);
        }
      }
    }
    // the mins' sums, then the f32 steps of every row
    __m512i mnpair[4];        // K-quants with mins (Q4_K): 8 groups, as 4 pairs of 16-bit mins per lane
    if (SUPER && mins)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
        mnpair[i] = _mm512_permutexvar_epi16(interleave, _mm512_cvtepi8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(p.mn + (t * ng + g0 + 2 * i) * LANES))));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + r) * ng + g0;
      __m512 msum = _mm512_setzero_ps();
      if (!SUPER && mins) {
        msum = _mm512_broadcastss_ps(_mm_load_ss(p.sxf + rg));
      } else if (mins) {
        __m512i m = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
#if SPECDEC_VNNI
          m = _mm512_dpwssd_epi32(m, mnpair[i], bcast32(p.sx16 + rg + 2 * i));
#else
          m = _mm512_add_epi32(m, _mm512_madd_epi16(mnpair[i], bcast32(p.sx16 + rg + 2 * i)));
#endif
        msum = _mm512_cvtepi32_ps(m);
      }
      acc[r] = apply_scales(mins, a, b, isum[r], msum, dx + r * nsb, acc[r]);
    }
  }
  const int64_t lanes = std::min<int64_t>(LANES, p.N - t * LANES);
  const __mmask16 keep = static_cast<__mmask16>((1u << lanes) - 1);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(p.y + (r0 + r) * p.ldy + t * LANES, keep, acc[r]);
}

template <int R>
SPECDEC_TARGET void tile_any(const Args& p, int64_t t, int64_t r0) {
  const bool super = p.SB > p.G;
  if (p.kind == U4) return super ? tile<R, U4, true>(p, t, r0) : tile<R, U4, false>(p, t, r0);
  if (p.kind == U6) return super ? tile<R, U6, true>(p, t, r0) : tile<R, U6, false>(p, t, r0);
  if (p.kind == U5) return super ? tile<R, U5, true>(p, t, r0) : tile<R, U5, false>(p, t, r0);
  return super ? tile<R, S8, true>(p, t, r0) : tile<R, S8, false>(p, t, r0);
}
