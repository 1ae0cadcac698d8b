// Choosing the next token from a row of logits, on the CPU.
//
// This is the same definition as `Sampler` in kiln/sampling.py, step for step, so that a seed picks
// the same tokens natively and in the browser whenever the logits agree (README, "Chat in the browser"):
//   1. penalties, in float64: repetition (÷ a positive logit, × a negative one) on every token of
//      the prompt and the output, then presence + frequency × count on every token of the output;
//   2. tokens a response format does not allow next get -Infinity (structured.js);
//      below temperature 1e-5, greedy: the first maximum;
//   3. divide by the temperature;
//   4. top_k: the k largest, ties going to the lower id;
//   5. weights exp(x - max) with `expNonPositive`; top_p keeps the most likely tokens (ties to the
//      lower id), one by one, until their weight reaches top_p × the weight of all candidates;
//   6. draw: u from mulberry32, the first kept token in id order whose running weight exceeds
//      u × their total. Every sum runs in float64 in that stated order.

/** A seeded pseudo-random generator (mulberry32 on the seed's low 32 bits) returning floats in [0, 1). */
export function seededRandom(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 2 ** 32;
  };
}

export function randomSeed() {
  return crypto.getRandomValues(new Uint32Array(1))[0];
}

export function argmax(logits) {
  let best = 0;
  for (let i = 1; i < logits.length; ++i) if (logits[i] > logits[best]) best = i;
  return best;
}

/** The `k` largest logits as {ids, logits}, largest first; ties keep the lower id first. */
export function topK(logits, k) {
  const ids = [];
  for (let i = 0; i < logits.length; ++i) {
    if (ids.length === k && logits[i] <= logits[ids[k - 1]]) continue;
    let at = ids.length;
    while (at > 0 && logits[ids[at - 1]] < logits[i]) --at;
    ids.splice(at, 0, i);
    if (ids.length > k) ids.pop();
  }
  return { ids, logits: ids.map((id) => logits[id]) };
}

const GREEDY_BELOW_TEMPERATURE = 1e-5;
const LOG2E = 1.4426950408889634;
const LN2_HI = 6.93147180369123816490e-01; // ln 2 split so that k × LN2_HI is exact (fdlibm's constants)
const LN2_LO = 1.90821492927058770002e-10;
const EXP_UNDERFLOW = -708; // below, e^x is subnormal: its weight counts as 0
const EXP_TERMS = [1]; // 1 / n! for n = 0 … 13
for (let n = 1; n <= 13; ++n) EXP_TERMS.push(EXP_TERMS[n - 1] / n);
const POWERS_OF_TWO = Array.from({ length: 1022 }, (_, n) => 2 ** -n); // 2^-n, exact; Math.pow per call is slow

/**
 * e^x for x ≤ 0 from + − × ÷ alone, which IEEE 754 rounds the same in every language: Math.exp and
 * numpy's exp differ in the last bit on about 1 argument in 10, and the weights must be equal bit
 * for bit on both sides. Taylor's series to x^13 on |r| ≤ ln2 / 2: within an ulp of e^x.
 */
export function expNonPositive(x) {
  if (x < EXP_UNDERFLOW) return 0;
  const k = Math.floor(x * LOG2E + 0.5);
  const r = (x - k * LN2_HI) - k * LN2_LO;
  let sum = EXP_TERMS[EXP_TERMS.length - 1];
  for (let n = EXP_TERMS.length - 2; n >= 0; --n) sum = sum * r + EXP_TERMS[n];
  return sum * POWERS_OF_TWO[-k];
}

/** The values of `ids`, largest first (a typed array's sort is native: a comparator's costs 10x more). */
function descending(ids, valueOf) {
  const sorted = new Float64Array(ids.length);
  for (let i = 0; i < ids.length; ++i) sorted[i] = valueOf(ids[i]);
  return sorted.sort().reverse();
}

/**
 * The first `count` of `ids` (in id order) from the largest value down, ties lower id first, in id
 * order; `sorted` holds the largest values of `ids` in descending order, at least `count` of them.
 */
function firstRanked(ids, valueOf, sorted, count) {
  const last = sorted[count - 1];
  let tiesKept = count - sorted.indexOf(last);
  const kept = [];
  for (let i = 0; i < ids.length; ++i) {
    const value = valueOf(ids[i]);
    if (value > last || (value === last && tiesKept-- > 0)) kept.push(ids[i]);
  }
  return kept;
}

/** Those of `ids` whose value is at least `threshold`, in id order. */
function idsFrom(ids, valueOf, threshold) {
  const kept = [];
  for (let i = 0; i < ids.length; ++i) if (valueOf(ids[i]) >= threshold) kept.push(ids[i]);
  return kept;
}

/** The `count`-th largest value of `ids` (a min-heap of `count` values: no sort of them all). */
function kthLargest(ids, valueOf, count) {
  const heap = new Float64Array(count);
  let size = 0;
  for (let i = 0; i < ids.length; ++i) {
    const value = valueOf(ids[i]);
    if (size < count) {
      let at = size++;
      while (at > 0 && heap[(at - 1) >> 1] > value) {
        heap[at] = heap[(at - 1) >> 1];
        at = (at - 1) >> 1;
      }
      heap[at] = value;
    } else if (value > heap[0]) {
      let at = 0;
      for (;;) {
        const child = 2 * at + 1;
        if (child >= count) break;
        const smaller = child + 1 < count && heap[child + 1] < heap[child] ? child + 1 : child;
        if (heap[smaller] >= value) break;
        heap[at] = heap[smaller];
        at = smaller;
      }
      heap[at] = value;
    }
  }
  return heap[0];
}

/**
 * The token choice of one generation: `settings` = {temperature, topP, topK, repetitionPenalty,
 * presencePenalty, frequencyPenalty, seed}; `promptIds` count for the repetition penalty.
 *
 * A row is read where it lies (a view of the model's output) and never copied or sorted whole: the
 * penalties change only the tokens seen, top_k selects with a heap of k, top_p sorts only the top
 * tokens that already hold its weight (as kiln/sampling.py does), and the weights go into a buffer
 * the sampler keeps from step to step. A 262k-word row costs a few passes over it.
 */
export class Sampler {
  constructor(settings, promptIds) {
    this.settings = settings;
    this.random = seededRandom(settings.seed);
    this.seen = new Set(promptIds);
    this.outputCounts = new Map();
    this.ids = null; // 0 … vocabulary size - 1
    this.weights = null; // one per token id, reused by every step
  }

  /** Count a chosen token for the penalties. */
  record(token) {
    this.seen.add(token);
    this.outputCounts.set(token, (this.outputCounts.get(token) ?? 0) + 1);
  }

  /** The penalized values of the tokens the penalties change, by id (float64). */
  penalized(logits) {
    const { repetitionPenalty, presencePenalty, frequencyPenalty } = this.settings;
    const changed = new Map();
    if (repetitionPenalty !== 1) {
      for (const id of this.seen) {
        const value = logits[id];
        changed.set(id, value > 0 ? value / repetitionPenalty : value * repetitionPenalty);
      }
    }
    for (const [id, count] of this.outputCounts) {
      changed.set(id, (changed.get(id) ?? logits[id]) - (presencePenalty + frequencyPenalty * count));
    }
    return changed;
  }

  /**
   * The next token for `logits` (a Float32Array row); with `allowed` (1 per token id that may come
   * next), one of the allowed tokens. The mask is applied here, on the host, rather than on the
   * device with the library's `apply_bitmask_inplace`: the logits come to the host every step
   * anyway, so masking costs no extra upload or dispatch, and it is the native sampler's code path.
   * -Infinity goes through the steps below as numpy takes it: never the first maximum while a
   * finite logit is left, weight 0 from expNonPositive, ranked last by top_k and top_p.
   */
  sample(logits, allowed = null) {
    const { temperature, topK: k, topP } = this.settings;
    const changed = this.penalized(logits);
    if (temperature < GREEDY_BELOW_TEMPERATURE) return firstMaximum(logits, changed, allowed);
    const size = logits.length;
    if (this.ids?.length !== size) {
      this.ids = Int32Array.from({ length: size }, (_, id) => id);
      this.weights = new Float64Array(size);
      this.penalties = new Float64Array(size);
      this.isPenalized = new Uint8Array(size);
    }
    const { penalties, isPenalized, weights } = this;
    for (const [id, value] of changed) {
      penalties[id] = value;
      isPenalized[id] = 1;
    }
    const scaledOf = allowed
      ? (id) => (allowed[id] ? (isPenalized[id] ? penalties[id] : logits[id]) / temperature : -Infinity)
      : (id) => (isPenalized[id] ? penalties[id] : logits[id]) / temperature;
    let ids = this.ids;
    if (k > 0 && k < size) {
      const candidates = idsFrom(ids, scaledOf, kthLargest(ids, scaledOf, k));
      ids = firstRanked(candidates, scaledOf, descending(candidates, scaledOf), k);
    }
    let max = -Infinity;
    for (let i = 0; i < ids.length; ++i) max = Math.max(max, scaledOf(ids[i]));
    let total = 0;
    const nearest = []; // within 1 of the largest value: the first tokens top_p sorts
    for (let i = 0; i < ids.length; ++i) {
      const scaled = scaledOf(ids[i]);
      total += weights[ids[i]] = expNonPositive(scaled - max);
      if (scaled >= max - 1) nearest.push(ids[i]);
    }
    if (topP < 1) {
      ids = nucleus(ids, scaledOf, nearest, topP * total, max);
      total = 0;
      for (let i = 0; i < ids.length; ++i) total += weights[ids[i]];
    }
    for (const id of changed.keys()) isPenalized[id] = 0;
    return draw(ids, weights, this.random() * total);
  }
}

/**
 * The first maximum of the penalized row (greedy): one pass over the logits, skipping the tokens
 * the penalties change or the mask forbids, then those changed.
 */
function firstMaximum(logits, changed, allowed) {
  let best = -1;
  let bestValue = -Infinity;
  for (let id = 0; id < logits.length; ++id) {
    if (logits[id] > bestValue && !changed.has(id) && (!allowed || allowed[id])) {
      best = id;
      bestValue = logits[id];
    }
  }
  for (const [id, value] of changed) {
    if (id < logits.length && (!allowed || allowed[id]) && (value > bestValue || (value === bestValue && id < best))) {
      best = id;
      bestValue = value;
    }
  }
  return best < 0 ? 0 : best; // every token at -Infinity: the first one, as numpy's argmax
}

/**
 * The most likely of `ids` whose weight first reaches `threshold`, in id order. Sorts only the
 * tokens within a distance of the largest value (`nearest`: those within 1), that distance
 * doubling until they hold the weight: they are a prefix of the full ranking, so the cut is the one
 * a full sort would give.
 */
function nucleus(ids, scaledOf, nearest, threshold, max) {
  for (let distance = 1; ; distance *= 2) {
    const whole = max - distance < EXP_UNDERFLOW || !Number.isFinite(max);
    const top = whole ? ids : distance === 1 ? nearest : idsFrom(ids, scaledOf, max - distance);
    const sorted = descending(top, scaledOf);
    let count = 0;
    let reached = 0;
    while (count < sorted.length && reached < threshold) reached += expNonPositive(sorted[count++] - max);
    if (reached >= threshold || whole) return firstRanked(ids, scaledOf, sorted, count);
  }
}

/** The first of `ids` whose running weight exceeds `target` (the last if rounding leaves none). */
function draw(ids, weights, target) {
  let running = 0;
  for (let i = 0; i < ids.length; ++i) {
    running += weights[ids[i]];
    if (running > target) return ids[i];
  }
  return ids[ids.length - 1];
}
