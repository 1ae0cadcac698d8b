// Choosing the next token from a row of logits, on the CPU.
//
// Logits come to the host every step anyway (parity checks report the top-K per step), and the
// argmax here is the same as numpy's on the native side (the first index of the maximum), so
// greedy decoding agrees across devices whenever the logits do.

/** A seeded pseudo-random generator (mulberry32) returning floats in [0, 1). */
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

/**
 * Sample a token: greedy at temperature 0, else softmax(logits / temperature) restricted to the
 * smallest set of most likely tokens whose probability reaches `topP` (nucleus sampling).
 */
export function sampleToken(logits, { temperature, topP }, random) {
  if (temperature === 0) return argmax(logits);
  const maxLogit = logits[argmax(logits)];
  const weights = new Float64Array(logits.length);
  let total = 0;
  for (let i = 0; i < logits.length; ++i) {
    weights[i] = Math.exp((logits[i] - maxLogit) / temperature);
    total += weights[i];
  }
  let candidates;
  if (topP < 1) {
    const order = Array.from(weights.keys()).sort((x, y) => weights[y] - weights[x]);
    candidates = [];
    let kept = 0;
    for (const id of order) {
      candidates.push(id);
      kept += weights[id];
      if (kept >= topP * total) break;
    }
    total = kept;
  } else {
    candidates = weights.keys();
  }
  let target = random() * total;
  let last = 0;
  for (const id of candidates) {
    target -= weights[id];
    last = id;
    if (target < 0) return id;
  }
  return last;
}
