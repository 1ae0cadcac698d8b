// MD5 (RFC 1321), incremental: the tensor cache records each shard's md5 and SubtleCrypto has
// no md5, so shards are hashed here while they stream in.

// Per-round left-rotation amounts.
const SHIFTS = Int32Array.of(
  7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22,
  5, 9, 14, 20, 5, 9, 14, 20, 5, 9, 14, 20, 5, 9, 14, 20,
  4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23,
  6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21,
);
// K[i] = floor(abs(sin(i + 1)) * 2^32).
const SINE_TABLE = Int32Array.from({ length: 64 }, (_, i) => Math.floor(Math.abs(Math.sin(i + 1)) * 2 ** 32));
const BLOCK_BYTES = 64;

export class Md5 {
  constructor() {
    this.state = Uint32Array.of(0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476);
    this.pending = new Uint8Array(BLOCK_BYTES);
    this.pendingLength = 0;
    this.totalBytes = 0;
    this.words = new Int32Array(16);
  }

  /** Add bytes (a Uint8Array) to the digest. */
  update(bytes) {
    this.totalBytes += bytes.length;
    let offset = 0;
    if (this.pendingLength > 0) {
      const take = Math.min(BLOCK_BYTES - this.pendingLength, bytes.length);
      this.pending.set(bytes.subarray(0, take), this.pendingLength);
      this.pendingLength += take;
      offset = take;
      if (this.pendingLength < BLOCK_BYTES) return this;
      this.compress(this.pending, 0);
      this.pendingLength = 0;
    }
    for (; offset + BLOCK_BYTES <= bytes.length; offset += BLOCK_BYTES) this.compress(bytes, offset);
    this.pending.set(bytes.subarray(offset), 0);
    this.pendingLength = bytes.length - offset;
    return this;
  }

  /** The digest as 32 lowercase hex digits; the object must not be updated afterwards. */
  hexdigest() {
    const bitLength = this.totalBytes * 8;
    const padLength = ((this.pendingLength < 56 ? 56 : 120) - this.pendingLength);
    const tail = new Uint8Array(padLength + 8);
    tail[0] = 0x80;
    const view = new DataView(tail.buffer);
    view.setUint32(padLength, bitLength >>> 0, true);
    view.setUint32(padLength + 4, Math.floor(bitLength / 2 ** 32), true);
    const total = this.totalBytes;
    this.update(tail);
    this.totalBytes = total;
    let hex = "";
    for (const word of this.state) {
      for (let shift = 0; shift < 32; shift += 8) hex += ((word >>> shift) & 0xff).toString(16).padStart(2, "0");
    }
    return hex;
  }

  compress(bytes, offset) {
    const words = this.words;
    for (let i = 0; i < 16; ++i) {
      const at = offset + 4 * i;
      words[i] = bytes[at] | (bytes[at + 1] << 8) | (bytes[at + 2] << 16) | (bytes[at + 3] << 24);
    }
    let a = this.state[0] | 0;
    let b = this.state[1] | 0;
    let c = this.state[2] | 0;
    let d = this.state[3] | 0;
    // The four rounds differ only in the mixing function and the word order; one loop each
    // keeps the hot path free of branches (about 4x faster than one loop with a switch).
    for (let i = 0; i < 16; ++i) {
      const sum = (a + ((b & c) | (~b & d)) + SINE_TABLE[i] + words[i]) | 0;
      a = d; d = c; c = b;
      b = (b + ((sum << SHIFTS[i]) | (sum >>> (32 - SHIFTS[i])))) | 0;
    }
    for (let i = 16; i < 32; ++i) {
      const sum = (a + ((d & b) | (~d & c)) + SINE_TABLE[i] + words[(5 * i + 1) & 15]) | 0;
      a = d; d = c; c = b;
      b = (b + ((sum << SHIFTS[i]) | (sum >>> (32 - SHIFTS[i])))) | 0;
    }
    for (let i = 32; i < 48; ++i) {
      const sum = (a + (b ^ c ^ d) + SINE_TABLE[i] + words[(3 * i + 5) & 15]) | 0;
      a = d; d = c; c = b;
      b = (b + ((sum << SHIFTS[i]) | (sum >>> (32 - SHIFTS[i])))) | 0;
    }
    for (let i = 48; i < 64; ++i) {
      const sum = (a + (c ^ (b | ~d)) + SINE_TABLE[i] + words[(7 * i) & 15]) | 0;
      a = d; d = c; c = b;
      b = (b + ((sum << SHIFTS[i]) | (sum >>> (32 - SHIFTS[i])))) | 0;
    }
    this.state[0] += a;
    this.state[1] += b;
    this.state[2] += c;
    this.state[3] += d;
  }
}

/** md5 of one Uint8Array or string, as hex. */
export function md5Hex(data) {
  const bytes = typeof data === "string" ? new TextEncoder().encode(data) : data;
  return new Md5().update(bytes).hexdigest();
}
