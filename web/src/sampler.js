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
function descending(ids, values) {
  const sorted = new Float64Array(ids.length);
  for (let i = 0; i < ids.length; ++i) sorted[i] = values[ids[i]];
  return sorted.sort().reverse();
}

/**
 * The first `count` of `ids` from the largest value down, ties lower id first, in id order;
 * `sorted` = descending(ids, values).
 */
function firstRanked(ids, values, sorted, count) {
  const last = sorted[count - 1];
  let tiesKept = count - sorted.indexOf(last);
  return ids.filter((id) => values[id] > last || (values[id] === last && tiesKept-- > 0));
}

/**
 * The token choice of one generation: `settings` = {temperature, topP, topK, repetitionPenalty,
 * presencePenalty, frequencyPenalty, seed}; `promptIds` count for the repetition penalty.
 */
export class Sampler {
  constructor(settings, promptIds) {
    this.settings = settings;
    this.random = seededRandom(settings.seed);
    this.seen = new Set(promptIds);
    this.outputCounts = new Map();
  }

  /** Count a chosen token for the penalties. */
  record(token) {
    this.seen.add(token);
    this.outputCounts.set(token, (this.outputCounts.get(token) ?? 0) + 1);
  }

  penalized(logits) {
    const { repetitionPenalty, presencePenalty, frequencyPenalty } = this.settings;
    const penalized = Float64Array.from(logits);
    if (repetitionPenalty !== 1) {
      for (const id of this.seen) {
        penalized[id] = penalized[id] > 0 ? penalized[id] / repetitionPenalty : penalized[id] * repetitionPenalty;
      }
    }
    for (const [id, count] of this.outputCounts) penalized[id] -= presencePenalty + frequencyPenalty * count;
    return penalized;
  }

  /**
   * The next token for `logits` (a Float32Array row); with `allowed` (1 per token id that may come
   * next), one of the allowed tokens. The mask is applied here, on the host, rather than on the
   * device with the library's `apply_bitmask_inplace`: the logits come to the host every step
   * anyway, so masking costs no extra upload or dispatch, and it is the native sampler's code path.
   * -Infinity goes through the steps below as numpy takes it: never the first maximum while a
   * finite logit is left, weight 0 from expNonPositive, ranked last by topK and topP.
   */
  sample(logits, allowed = null) {
    const { temperature, topK: k, topP } = this.settings;
    const penalized = this.penalized(logits);
    if (allowed) {
      for (let id = 0; id < penalized.length; ++id) if (!allowed[id]) penalized[id] = -Infinity;
    }
    if (temperature < GREEDY_BELOW_TEMPERATURE) return argmax(penalized);
    const scaled = new Float64Array(penalized.length);
    for (let id = 0; id < scaled.length; ++id) scaled[id] = penalized[id] / temperature;
    let ids = new Int32Array(scaled.length);
    for (let id = 0; id < ids.length; ++id) ids[id] = id;
    if (k > 0 && k < ids.length) ids = firstRanked(ids, scaled, descending(ids, scaled), k);
    let max = -Infinity;
    for (const id of ids) max = Math.max(max, scaled[id]);
    const weights = new Float64Array(scaled.length);
    for (const id of ids) weights[id] = expNonPositive(scaled[id] - max);
    if (topP < 1) ids = nucleus(ids, scaled, weights, topP, max);
    return draw(ids, weights, this.random());
  }
}

/**
 * The most likely of `ids` whose weight first reaches `topP` of their total, in id order. Tied
 * tokens weigh the same, so the running weight needs only the sorted values, not their ids.
 */
function nucleus(ids, scaled, weights, topP, max) {
  let total = 0;
  for (const id of ids) total += weights[id];
  const sorted = descending(ids, scaled);
  let count = 0;
  let reached = 0;
  while (count < sorted.length && reached < topP * total) reached += expNonPositive(sorted[count++] - max);
  return firstRanked(ids, scaled, sorted, count);
}

/** The first of `ids` whose running weight exceeds u × their total (the last if rounding leaves none). */
function draw(ids, weights, u) {
  let total = 0;
  for (const id of ids) total += weights[id];
  const target = u * total;
  let running = 0;
  for (const id of ids) {
    running += weights[id];
    if (running > target) return id;
  }
  return ids[ids.length - 1];
}
