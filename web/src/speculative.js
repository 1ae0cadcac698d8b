// Speculative decoding: tokens proposed ahead of the reply, verified by the model in one pass. The
// same definition as kiln/speculative.py, step for step (read its docstring): `PromptLookup` copies
// what followed the latest earlier occurrence of the reply's last tokens; `Lookahead` verifies a
// proposal with one `prefill_all_logits` pass over the last token and the proposed ones, and the
// engine's sampler picks every token from its row as from a decode step's, with its own seeded
// draws: a seed gives the same reply with or without speculation.
import { EngineError } from "./errors.js";

export const OFF = "off";
export const METHODS = ["prompt-lookup"];

/** How a reply is decoded by default: n-grams of 2 to 4 tokens, proposals of 4 at first, at most 12. */
export const PROMPT_LOOKUP = { method: "prompt-lookup", ngramMin: 2, ngramMax: 4, firstProposal: 4, maxProposal: 12 };

/** The speculation a request asks for (its `speculative` field: "off" or "prompt-lookup"), else the engine's. */
export function speculationFor(request, engineSpeculation) {
  const asked = request.speculative;
  if (asked === undefined || asked === null) return engineSpeculation;
  if (asked === OFF) return null;
  if (!METHODS.includes(asked)) {
    throw new EngineError("bad-request", `speculative must be one of ${[OFF, ...METHODS].join(", ")}, got ${JSON.stringify(asked)}`);
  }
  return engineSpeculation ?? PROMPT_LOOKUP;
}

/** Proposes what followed the latest earlier occurrence of the history's last n tokens, the longest n that occurs. */
export class PromptLookup {
  constructor({ ngramMin, ngramMax }, history) {
    this.sizes = [];
    for (let n = ngramMax; n >= ngramMin; --n) this.sizes.push(n);
    this.history = [];
    // per size: n-gram (its ids joined) → where its latest occurrence with a token after it starts
    this.latest = new Map(this.sizes.map((n) => [n, new Map()]));
    this.extend(history);
  }

  extend(tokens) {
    for (const token of tokens) {
      this.history.push(token);
      for (const [n, latest] of this.latest) {
        const start = this.history.length - 1 - n;
        if (start >= 0) latest.set(this.history.slice(start, start + n).join(","), start);
      }
    }
  }

  propose(count) {
    for (const n of this.sizes) {
      if (this.history.length < n) continue;
      const start = this.latest.get(n).get(this.history.slice(-n).join(","));
      if (start !== undefined) return this.history.slice(start + n, start + n + count);
    }
    return [];
  }
}

/** One decode step per token: decoding without speculation. */
export class PlainDecoding {
  constructor(session) {
    this.session = session;
    this.stats = { steps: 0, proposed: 0, accepted: 0 };
  }

  async logitsAfter(token) {
    this.stats.steps += 1;
    return this.session.decode(token);
  }

  /** Leave the cache holding the reply's tokens and no proposed ones. */
  settle() {}
}

/**
 * Whether verify passes pay for themselves here, in time (`PassCosts` in kiln/speculative.py): where
 * their recent worth falls below zero, proposals pause for as many decode steps as keep the loss of
 * the pass that lost within LOSS_SHARE of their time, twice the pause before after each further loss
 * with no pass saving time between (at most MAX_PAUSE). A pass before any decode step is followed by
 * one, to judge passes by.
 */
export class PassCosts {
  static LOSS_SHARE = 0.1;
  static MAX_PAUSE = 256;

  constructor() {
    this.decodeSeconds = null; // a decode step's time, a running mean
    this.worth = 0; // seconds a pass saved, a running mean
    this.pause = 0; // decode steps before the next proposal
    this.backoff = 1; // what the next pause is multiplied by: doubled at each, 1 once a pass saves time
  }

  decoded(seconds) {
    this.decodeSeconds = this.decodeSeconds === null ? seconds : 0.8 * this.decodeSeconds + 0.2 * seconds;
  }

  verified(seconds, accepted) {
    if (this.decodeSeconds === null) {
      this.pause = 1; // no decode step to judge it by yet: take one next (a draft always proposes)
      return;
    }
    const saved = accepted * this.decodeSeconds - (seconds - this.decodeSeconds);
    this.worth = 0.5 * this.worth + 0.5 * saved;
    if (saved > 0) {
      this.backoff = 1;
    } else if (saved < 0 && this.worth < 0) {
      const pause = Math.ceil(-saved / (PassCosts.LOSS_SHARE * this.decodeSeconds)) * this.backoff;
      this.pause = Math.min(PassCosts.MAX_PAUSE, pause);
      this.backoff = Math.min(PassCosts.MAX_PAUSE, 2 * this.backoff);
      this.worth = 0;
    }
  }

  mayPropose() {
    if (this.pause > 0) {
      this.pause -= 1;
      return false;
    }
    return true;
  }
}

const seconds = (start) => (performance.now() - start) / 1000;

/** Verified rows ahead of the reply, as `Lookahead` in kiln/speculative.py. */
export class Lookahead extends PlainDecoding {
  constructor(session, proposer, speculation, constraint = null) {
    super(session);
    this.proposer = proposer;
    this.speculation = speculation;
    this.constraint = constraint;
    this.proposalLength = speculation.firstProposal;
    this.rows = []; // [{token, logits}]
    this.costs = new PassCosts();
    this.passSeconds = 0; // the time of the pass the rows came from
    this.passAccepted = 0; // its rows the reply took so far
  }

  async logitsAfter(token) {
    this.proposer.extend([token]);
    if (this.rows.length > 0 && this.rows[0].token === token) {
      this.stats.accepted += 1;
      this.passAccepted += 1;
      const row = this.rows.shift();
      if (this.rows.length === 0) {
        this.proposalLength = Math.min(this.speculation.maxProposal, this.proposalLength * 2);
        this.costs.verified(this.passSeconds, this.passAccepted);
      }
      return row.logits;
    }
    if (this.rows.length > 0) {
      this.proposalLength = Math.max(1, Math.floor(this.proposalLength / 2));
      this.costs.verified(this.passSeconds, this.passAccepted);
      this.settle();
    }
    const proposal = this.costs.mayPropose() ? this.proposal() : [];
    const started = performance.now();
    if (proposal.length === 0) {
      const logits = await super.logitsAfter(token);
      this.costs.decoded(seconds(started));
      return logits;
    }
    this.stats.steps += 1;
    this.stats.proposed += proposal.length;
    const logits = await this.session.allLogits([token, ...proposal]);
    this.passSeconds = seconds(started);
    this.passAccepted = 0;
    this.rows = proposal.map((proposed, i) => ({ token: proposed, logits: logits[i + 1] }));
    return logits[0];
  }

  proposal() {
    const room = this.session.speculationRoom() - 1; // the token itself goes first
    let proposal = room > 0 ? this.proposer.propose(Math.min(this.proposalLength, room)) : [];
    if (proposal.length > 0 && this.constraint) proposal = proposal.slice(0, this.constraint.fitting(proposal));
    return proposal;
  }

  settle() {
    if (this.rows.length > 0) {
      this.session.rollback(this.rows.length);
      this.rows = [];
    }
  }
}

/** What runs a reply's model steps after its prompt: plain decoding or a Lookahead. */
export function decodingSteps(session, speculation, promptIds, constraint) {
  if (!speculation) return new PlainDecoding(session);
  return new Lookahead(session, new PromptLookup(speculation, promptIds), speculation, constraint);
}
