/* Sampling a row of logits on the host without sorting the vocabulary.
 *
 * llama.cpp's sampler chain fills a candidate array of the whole vocabulary (12 bytes a token),
 * sorts it for top-k and top-p and exponentiates it with libm one token at a time; one row of a
 * 128k vocabulary took most of a millisecond, and cllm sampled a step's rows one after another.
 * Here a row costs a few vectorized passes over its logits, and rows are independent (each
 * sequence has its own generator), so a step's rows are sampled in parallel:
 *
 *   - every filter is a floor on the logits: min-p's is max + log(min_p); top-k's (the k-th
 *     largest logit) and top-p's (the logit of the last of the best tokens holding p of the
 *     probability) are found by bisecting on the floor with vectorized counts and sums until
 *     at most WINDOW tokens lie between the bounds, then selecting among those (quickselect):
 *     no sort. Tokens tied with a cut are all kept;
 *   - the draw: one pass that writes each token's weight exp((l - max) / T) above the floor
 *     and sums them in blocks, and an inverse-CDF draw (one uniform number) that walks the
 *     block sums and then one block.
 *
 * The exponential is a polynomial the compiler vectorizes (relative error under 2e-7; the build
 * compiles this file with -fno-trapping-math, without which GCC keeps the comparisons of the
 * vector loops as branches and vectorizes nothing: 5 ns a token instead of ~0.5); a weight
 * below 2^-126 of the best token's is 0, so a token whose logit is -inf (banned, masked) is
 * never drawn. A seed fixes the generator (xoshiro256**), so a seeded text repeats on the same
 * build and device.
 */
#include "row_sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The vector loops below, built for the host's widest vector unit where the compiler can pick
   one at load time. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

#define LANES 16
#define BLOCK 256 /* tokens summed together: the draw walks the blocks' sums, then one block */

struct cllm_row_sampler {
    struct cllm_sampling p;
    uint64_t rng[4];
    double staged; /* the next uniform number, drawn ahead for the device (has_staged) */
    int has_staged;
    int32_t * recent; /* ring of the latest penalty_last_n tokens */
    int32_t n_recent, next;
};

struct cllm_sampler_scratch {
    int32_t n_vocab;
    float * weight;      /* per token */
    float * logit;       /* candidates' logits */
    float * cand_weight; /* candidates' weights */
    int32_t * count; /* per token, all 0 between calls: the penalties' counts */
    float * block;   /* per BLOCK tokens: the sum of their weights */
};

static uint64_t splitmix64(uint64_t * x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

static uint64_t next_u64(uint64_t s[4]) {  /* xoshiro256** */
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

static double uniform(uint64_t s[4]) {  /* in [0, 1) */
    return (double) (next_u64(s) >> 11) * 0x1.0p-53;
}

struct cllm_row_sampler * cllm_row_sampler_new(const struct cllm_sampling * params) {
    struct cllm_row_sampler * s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return NULL;
    }
    s->p = *params;
    if (s->p.penalty_last_n > 0) {
        s->recent = malloc((size_t) s->p.penalty_last_n * sizeof(int32_t));
        if (s->recent == NULL) {
            free(s);
            return NULL;
        }
    }
    uint64_t x = params->seed;
    for (int i = 0; i < 4; i++) {
        s->rng[i] = splitmix64(&x);
    }
    return s;
}

void cllm_row_sampler_free(struct cllm_row_sampler * s) {
    if (s != NULL) {
        free(s->recent);
        free(s);
    }
}

const struct cllm_sampling * cllm_row_sampler_params(const struct cllm_row_sampler * s) {
    return &s->p;
}

double cllm_row_sampler_stage(struct cllm_row_sampler * s) {
    s->staged = uniform(s->rng);
    s->has_staged = 1;
    return s->staged;
}

double cllm_row_sampler_take(struct cllm_row_sampler * s) {
    if (s->has_staged) {
        s->has_staged = 0;
        return s->staged;
    }
    return uniform(s->rng);
}

void cllm_row_sampler_accept(struct cllm_row_sampler * s, int32_t token) {
    const int32_t cap = s->p.penalty_last_n;
    if (cap <= 0) {
        return;
    }
    s->recent[s->next] = token;
    s->next = (s->next + 1) % cap;
    if (s->n_recent < cap) {
        s->n_recent++;
    }
}

struct cllm_sampler_scratch * cllm_sampler_scratch_new(int32_t n_vocab) {
    struct cllm_sampler_scratch * w = calloc(1, sizeof(*w));
    if (w == NULL) {
        return NULL;
    }
    const size_t n = (size_t) n_vocab;
    w->n_vocab = n_vocab;
    w->weight = malloc(n * sizeof(float));
    w->logit = malloc(n * sizeof(float));
    w->cand_weight = malloc(n * sizeof(float));
    w->count = calloc(n, sizeof(int32_t));
    w->block = malloc((n / BLOCK + 1) * sizeof(float));
    if (w->weight == NULL || w->logit == NULL || w->cand_weight == NULL || w->count == NULL
            || w->block == NULL) {
        cllm_sampler_scratch_free(w);
        return NULL;
    }
    return w;
}

void cllm_sampler_scratch_free(struct cllm_sampler_scratch * w) {
    if (w != NULL) {
        free(w->weight);
        free(w->logit);
        free(w->cand_weight);
        free(w->count);
        free(w->block);
        free(w);
    }
}

/* exp(x) for x <= 0: 2^n * 2^f with n = round(x / ln 2), |f| <= 1/2, 2^f by its Taylor series to
   the 6th power of f ln 2 (relative error under 2e-7), 2^n built in the float's exponent bits.
   Below 2^-126 (x < -87.3, -inf included) it is exactly 0. Branch-free, so loops vectorize. */
static inline float exp_nonpositive(float x) {
    float t = x * 1.44269504f;
    t = t < -127.0f ? -127.0f : t;
    const float n = (t + 0x1.8p23f) - 0x1.8p23f; /* round to nearest */
    const float y = (t - n) * 0.693147181f;
    const float p = 1.0f + y * (1.0f + y * (0.5f + y * (1.0f / 6 + y * (1.0f / 24
                    + y * (1.0f / 120 + y * (1.0f / 720))))));
    const uint32_t bits = (uint32_t) ((int32_t) n + 127) << 23; /* n = -127: 0 */
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}

VECTOR_CLONES
static float row_max(const float * x, int32_t n) {
    float lanes[LANES];
    int32_t i = 0, j;
    for (j = 0; j < LANES; j++) {
        lanes[j] = -INFINITY;
    }
    for (; i + LANES <= n; i += LANES) {
        for (j = 0; j < LANES; j++) {
            lanes[j] = lanes[j] >= x[i + j] ? lanes[j] : x[i + j];
        }
    }
    float best = -INFINITY;
    for (j = 0; j < LANES; j++) {
        best = lanes[j] > best ? lanes[j] : best;
    }
    for (; i < n; i++) {
        best = x[i] > best ? x[i] : best;
    }
    return best;
}

/* weight[i] = exp((x[i] - max) * scale) where x[i] >= floor, else 0, for a block of tokens;
   returns their sum (summed in lanes, then the lanes in order: the same on every run). */
VECTOR_CLONES
static float weigh_block(const float * restrict x, int32_t n, float max, float scale,
                         float floor, float * restrict weight) {
    float lanes[LANES] = {0};
    int32_t i = 0, j;
    for (; i + LANES <= n; i += LANES) {
        for (j = 0; j < LANES; j++) {
            const float e = exp_nonpositive((x[i + j] - max) * scale);
            const float w = x[i + j] >= floor ? e : 0.0f;
            weight[i + j] = w;
            lanes[j] += w;
        }
    }
    float sum = 0.0f;
    for (; i < n; i++) {
        const float w = x[i] >= floor ? exp_nonpositive((x[i] - max) * scale) : 0.0f;
        weight[i] = w;
        sum += w;
    }
    for (j = 0; j < LANES; j++) {
        sum += lanes[j];
    }
    return sum;
}

/* The index of the entry where the running sum of `weight` passes `target`; the last entry with
   a weight where rounding leaves the target unreached. -1 where every weight is 0. */
static int32_t walk(const float * weight, int32_t n, double target) {
    double acc = 0.0;
    int32_t last = -1;
    for (int32_t i = 0; i < n; i++) {
        if (weight[i] > 0.0f) {
            acc += weight[i];
            last = i;
            if (acc > target) {
                return i;
            }
        }
    }
    return last;
}

/* Temperature over every token whose logit reaches `floor`: weigh each block, draw one uniform
   number, find its block by the blocks' sums and its token inside that block. */
static int32_t draw_all(struct cllm_row_sampler * s, float * logits, int32_t n, float max,
                        float scale, float floor, struct cllm_sampler_scratch * w) {
    const int32_t n_blocks = (n + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int32_t b = 0; b < n_blocks; b++) {
        const int32_t first = b * BLOCK, size = n - first < BLOCK ? n - first : BLOCK;
        w->block[b] = weigh_block(logits + first, size, max, scale, floor, w->weight + first);
        total += w->block[b];
    }
    const double target = cllm_row_sampler_take(s) * total;
    const int32_t b = walk(w->block, n_blocks, target);
    if (b < 0) {
        return -1;
    }
    double acc = 0.0; /* the blocks before b, summed as walk summed them */
    for (int32_t c = 0; c < b; c++) {
        acc += w->block[c] > 0.0f ? w->block[c] : 0.0f;
    }
    const int32_t first = b * BLOCK, size = n - first < BLOCK ? n - first : BLOCK;
    const int32_t i = walk(w->weight + first, size, target - acc);
    return i < 0 ? -1 : first + i;
}

/* How many tokens have a logit of at least `tau`, and their weights' sum (`weight` NULL: 0). */
VECTOR_CLONES
static void tally(const float * restrict x, const float * restrict weight, int32_t n, float tau,
                  int32_t * count, float * mass) {
    int32_t counts[LANES] = {0};
    float sums[LANES] = {0};
    const int32_t whole = n - n % LANES;
    for (int32_t i = 0; i < whole; i += LANES) {
        for (int32_t j = 0; j < LANES; j++) {
            counts[j] += x[i + j] >= tau ? 1 : 0;
        }
    }
    if (weight != NULL) {
        for (int32_t i = 0; i < whole; i += LANES) {
            for (int32_t j = 0; j < LANES; j++) {
                sums[j] += x[i + j] >= tau ? weight[i + j] : 0.0f;
            }
        }
    }
    int32_t c = 0;
    float m = 0.0f;
    for (int32_t i = whole; i < n; i++) {
        c += x[i] >= tau ? 1 : 0;
        m += x[i] >= tau && weight != NULL ? weight[i] : 0.0f;
    }
    for (int32_t j = 0; j < LANES; j++) {
        c += counts[j];
        m += sums[j];
    }
    *count = c;
    *mass = m;
}

static void swap_candidates(struct cllm_sampler_scratch * w, int32_t a, int32_t b) {
    const float l = w->logit[a], x = w->cand_weight[a];
    w->logit[a] = w->logit[b];
    w->cand_weight[a] = w->cand_weight[b];
    w->logit[b] = l;
    w->cand_weight[b] = x;
}

/* Arrange candidates [lo, hi) as logits above `pivot`, equal to it, below it; *gt and *eq
   receive where the equal ones and the lower ones start. */
static void partition3(struct cllm_sampler_scratch * w, int32_t lo, int32_t hi, float pivot,
                       int32_t * gt, int32_t * eq) {
    int32_t a = lo, i = lo, b = hi;
    while (i < b) {
        const float l = w->logit[i];
        if (l > pivot) {
            swap_candidates(w, a++, i++);
        } else if (l < pivot) {
            swap_candidates(w, i, --b);
        } else {
            i++;
        }
    }
    *gt = a;
    *eq = b;
}

static float median3(float a, float b, float c) {
    if (a > b) {
        const float t = a;
        a = b;
        b = t;
    }
    return c <= a ? a : c >= b ? b : c;
}

static float pivot_of(const struct cllm_sampler_scratch * w, int32_t lo, int32_t hi) {
    return median3(w->logit[lo], w->logit[lo + (hi - lo) / 2], w->logit[hi - 1]);
}

/* The k-th largest logit of candidates [0, n), 1 <= k <= n (quickselect). */
static float kth_largest(struct cllm_sampler_scratch * w, int32_t n, int32_t k) {
    int32_t lo = 0, hi = n, gt, eq;
    for (;;) {
        const float pivot = pivot_of(w, lo, hi);
        partition3(w, lo, hi, pivot, &gt, &eq);
        if (k - 1 < gt) {
            hi = gt;
        } else if (k - 1 < eq) {
            return pivot;
        } else {
            lo = eq;
        }
    }
}

/* The logit of the last of the best candidates of [0, n) whose weights, counted from the best
   down, reach `target` (> 0): top-p's cut, found by partitioning, not sorting. */
static float mass_cut(struct cllm_sampler_scratch * w, int32_t n, double target) {
    int32_t lo = 0, hi = n, gt, eq;
    double acc = 0.0; /* the weight of [0, lo), all kept */
    float cut = w->logit[0];
    while (lo < hi) {
        const float pivot = pivot_of(w, lo, hi);
        partition3(w, lo, hi, pivot, &gt, &eq);
        double above = 0.0;
        for (int32_t i = lo; i < gt; i++) {
            above += w->cand_weight[i];
        }
        if (gt > lo && acc + above >= target) {
            hi = gt; /* the cut lies among the candidates above the pivot */
            continue;
        }
        acc += above + (double) w->cand_weight[gt] * (eq - gt);
        cut = pivot;
        if (acc >= target) {
            return pivot;
        }
        lo = eq;
    }
    return cut; /* rounding: every candidate */
}

/* Gather the logits (and weights) of the tokens in [lo, hi) as candidates; returns how many. */
static int32_t gather(const float * x, const float * weight, int32_t n, float lo, float hi,
                      struct cllm_sampler_scratch * w) {
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        if (x[i] >= lo && x[i] < hi) {
            w->logit[m] = x[i];
            w->cand_weight[m++] = weight != NULL ? weight[i] : 0.0f;
        }
    }
    return m;
}

/* Below this many tokens between its bounds, a threshold's search gathers them and selects. */
#define WINDOW 1024
/* Bounds below the best logit where the searches start: below it, a token's weight is under
   e^-40 of the best one's (the whole of a 128k vocabulary's under 1e-12 of it). */
#define SPAN 40.0f

/* The k-th largest logit (top-k keeps the tokens that reach it): bisection with vectorized
   counts until few tokens lie between the bounds, then a selection among those. */
static float top_k_floor(const float * x, int32_t n, float max, int32_t k,
                         struct cllm_sampler_scratch * w) {
    int32_t c_hi, c_lo, c;
    float unused;
    tally(x, NULL, n, max, &c_hi, &unused);
    if (c_hi >= k) {
        return max;
    }
    float lo = max - SPAN, hi = max;
    tally(x, NULL, n, lo, &c_lo, &unused);
    if (c_lo < k) {
        lo = -INFINITY; /* every token: gather the finite ones */
        tally(x, NULL, n, -FLT_MAX, &c_lo, &unused);
        if (c_lo <= k) {
            return -FLT_MAX;
        }
    }
    for (int it = 0; lo > -INFINITY && c_lo - c_hi > WINDOW && it < 24; it++) {
        const float mid = lo + (hi - lo) / 2;
        tally(x, NULL, n, mid, &c, &unused);
        if (c >= k) {
            lo = mid, c_lo = c;
        } else {
            hi = mid, c_hi = c;
        }
    }
    const int32_t m = gather(x, NULL, n, lo > -INFINITY ? lo : -FLT_MAX, hi, w);
    return kth_largest(w, m, k - c_hi);
}

/* Top-p's floor over the tokens that reach `lo`: the logit of the last of the best tokens whose
   weights (exp(l - max), in scratch) reach `target`. Bisection, then a selection as above. */
static float top_p_floor(const float * x, int32_t n, float max, float lo, float target,
                         struct cllm_sampler_scratch * w) {
    int32_t c_hi, c_lo, c;
    float m_hi, m_lo, m;
    float hi = max;
    tally(x, w->weight, n, hi, &c_hi, &m_hi);
    if (m_hi >= target) {
        return max;
    }
    tally(x, w->weight, n, lo, &c_lo, &m_lo);
    for (int it = 0; c_lo - c_hi > WINDOW && it < 24; it++) {
        const float mid = lo + (hi - lo) / 2;
        tally(x, w->weight, n, mid, &c, &m);
        if (m >= target) {
            lo = mid, c_lo = c, m_lo = m;
        } else {
            hi = mid, c_hi = c, m_hi = m;
        }
    }
    const int32_t k = gather(x, w->weight, n, lo, hi, w);
    return k > 0 ? mass_cut(w, k, (double) target - m_hi) : lo;
}

/* The lowest logit a token may have to be drawn: top-k's, then top-p's over what top-k kept,
   then min-p's. Tokens tied with a cut are all kept. */
static float filter_floor(const struct cllm_sampling * p, const float * x, int32_t n, float max,
                          struct cllm_sampler_scratch * w) {
    float floor = -FLT_MAX;
    if (p->top_k > 0) {
        floor = top_k_floor(x, n, max, p->top_k, w);
    }
    if (p->top_p < 1.0f) {
        const float lo = floor > max - SPAN ? floor : max - SPAN;
        int32_t kept;
        float total;
        weigh_block(x, n, max, 1.0f, lo, w->weight);
        tally(x, w->weight, n, lo, &kept, &total);
        const float cut = top_p_floor(x, n, max, lo, p->top_p * total, w);
        floor = cut > floor ? cut : floor;
    }
    if (p->min_p > 0.0f) {
        const float cut = max + logf(p->min_p);
        floor = cut > floor ? cut : floor;
    }
    return floor;
}

/* llama.cpp's penalties: a token seen c times among the latest has its logit divided by the
   repeat penalty (multiplied where negative), then c * frequency + presence taken off. */
static void apply_penalties(const struct cllm_row_sampler * s, float * logits, int32_t * count) {
    const struct cllm_sampling * p = &s->p;
    if (s->n_recent == 0 || (p->repeat_penalty == 1.0f && p->presence_penalty == 0.0f
                             && p->frequency_penalty == 0.0f)) {
        return;
    }
    for (int32_t i = 0; i < s->n_recent; i++) {
        count[s->recent[i]]++;
    }
    for (int32_t i = 0; i < s->n_recent; i++) {
        const int32_t token = s->recent[i];
        const int32_t c = count[token];
        if (c == 0) {
            continue;  /* already applied */
        }
        float l = logits[token];
        l = l <= 0.0f ? l * p->repeat_penalty : l / p->repeat_penalty;
        logits[token] = l - (float) c * p->frequency_penalty - p->presence_penalty;
        count[token] = 0;
    }
}

static int32_t first_of(const float * logits, int32_t n, float max) {
    for (int32_t i = 0; i < n; i++) {
        if (logits[i] == max) {
            return i;
        }
    }
    return -1;
}

int32_t cllm_row_sampler_sample(struct cllm_row_sampler * s, float * logits, int32_t n,
                                const int32_t * banned, int32_t n_banned,
                                struct cllm_sampler_scratch * w) {
    const struct cllm_sampling * p = &s->p;
    for (int32_t i = 0; i < n_banned; i++) {
        logits[banned[i]] = -INFINITY;
    }
    apply_penalties(s, logits, w->count);
    const float max = row_max(logits, n);
    int32_t token;
    if (!(max > -INFINITY)) {
        token = -1;
    } else if (p->temperature <= 0.0f) {
        token = first_of(logits, n, max);
    } else {
        const float scale = 1.0f / p->temperature;
        const float floor = filter_floor(p, logits, n, max, w);
        token = draw_all(s, logits, n, max, scale, floor, w);
        if (p->keep_distribution) {
            for (int32_t i = 0; i < n; i++) {
                logits[i] = logits[i] >= floor ? (logits[i] - max) * scale : -INFINITY;
            }
        }
    }
    if (token >= 0) {
        cllm_row_sampler_accept(s, token);
    }
    return token;
}
