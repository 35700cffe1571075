//! HPACK's Huffman code (RFC 7541, Appendix B): string literals decoded and
//! encoded.
//!
//! The code is canonical: codes of one length are consecutive in symbol
//! order, and each length's first code follows the shorter ones' last. So
//! the code lengths say it all, and the codes are computed from them.

/// Each symbol's code length in bits (RFC 7541, Appendix B); symbol 256 is
/// EOS, which never appears in a string.
const LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, //
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28, //
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, //
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, //
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, //
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, //
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, //
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, //
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, //
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, //
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, //
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, //
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, //
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, //
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, //
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, //
    30,
];

/// The longest code.
const MAX_LEN: usize = 30;

/// The code's tables, computed from [`LENGTHS`] at compile time.
struct Code {
    /// Each symbol's code, right-aligned.
    codes: [u32; 257],
    /// The symbols in canonical order: by length, then by value.
    sorted: [u16; 257],
    /// For each length: how many codes are that long or shorter, i.e. the
    /// index in `sorted` past that length's last symbol...
    before: [u16; MAX_LEN + 2],
    /// ...and the first code of that length, right-aligned.
    first: [u32; MAX_LEN + 2],
    /// For each length: the codes of that length or shorter are, read as
    /// the first bits of a left-aligned 32-bit window, below this.
    limit: [u64; MAX_LEN + 2],
}

const CODE: Code = Code::new();

impl Code {
    const fn new() -> Code {
        let mut sorted = [0u16; 257];
        let mut before = [0u16; MAX_LEN + 2];
        let mut n = 0;
        let mut len = 1;
        while len <= MAX_LEN {
            let mut sym = 0;
            while sym < 257 {
                if LENGTHS[sym] as usize == len {
                    sorted[n] = sym as u16;
                    n += 1;
                }
                sym += 1;
            }
            before[len] = n as u16;
            len += 1;
        }
        // Canonical codes: each length's first code is the previous
        // length's next code, shifted by one bit.
        let mut codes = [0u32; 257];
        let mut first = [0u32; MAX_LEN + 2];
        let mut limit = [0u64; MAX_LEN + 2];
        let mut next: u32 = 0;
        let mut len = 1;
        while len <= MAX_LEN {
            first[len] = next;
            let start = before[len - 1] as usize;
            let end = before[len] as usize;
            let mut i = start;
            while i < end {
                codes[sorted[i] as usize] = next;
                next += 1;
                i += 1;
            }
            limit[len] = (next as u64) << (32 - len);
            next <<= 1;
            len += 1;
        }
        Code {
            codes,
            sorted,
            before,
            first,
            limit,
        }
    }

    /// The symbol whose code begins `window` (the next 32 bits, left
    /// aligned), and its length.
    fn lookup(&self, window: u32) -> (u16, u32) {
        let mut len = 5;
        while len <= MAX_LEN {
            if (window as u64) < self.limit[len] {
                let code = window >> (32 - len);
                let index = self.before[len - 1] as u32 + (code - self.first[len]);
                return (self.sorted[index as usize], len as u32);
            }
            len += 1;
        }
        // Unreachable: the code is complete, EOS is all 30 ones.
        (256, MAX_LEN as u32)
    }
}

/// A Huffman-coded string that is not one (RFC 7541, 5.2): it holds EOS, or
/// ends with more than 7 bits of padding or padding that is not all ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HuffmanError;

/// Appends the string coded in `src` to `dst`.
pub fn decode(src: &[u8], dst: &mut Vec<u8>) -> Result<(), HuffmanError> {
    // Bits not yet decoded: the low `bits` bits of `acc`.
    let mut acc: u64 = 0;
    let mut bits: u32 = 0;
    let mut bytes = src.iter();
    loop {
        while bits <= 56 {
            match bytes.next() {
                Some(&b) => {
                    acc = (acc << 8) | u64::from(b);
                    bits += 8;
                }
                None => break,
            }
        }
        if bits == 0 {
            return Ok(());
        }
        // The next 32 bits, left-aligned; past the end, ones (as padding).
        let window = if bits >= 32 {
            (acc >> (bits - 32)) as u32
        } else {
            ((acc << (32 - bits)) as u32) | (u32::MAX >> bits)
        };
        let (sym, len) = CODE.lookup(window);
        if len > bits {
            // What is left is padding: a prefix of EOS, 7 bits at most.
            let rest = acc & ((1u64 << bits) - 1);
            return if bits <= 7 && rest == (1u64 << bits) - 1 {
                Ok(())
            } else {
                Err(HuffmanError)
            };
        }
        if sym == 256 {
            return Err(HuffmanError);
        }
        dst.push(sym as u8);
        bits -= len;
        acc &= (1u64 << bits) - 1;
    }
}

/// Appends `src` coded to `dst`, padded with ones to a whole byte. (sluice
/// writes its answers without Huffman coding; the tests code with this.)
pub fn encode(src: &[u8], dst: &mut Vec<u8>) {
    let mut acc: u64 = 0;
    let mut bits: u32 = 0;
    for &b in src {
        let len = u32::from(LENGTHS[b as usize]);
        acc = (acc << len) | u64::from(CODE.codes[b as usize]);
        bits += len;
        while bits >= 8 {
            bits -= 8;
            dst.push((acc >> bits) as u8);
        }
        acc &= (1u64 << bits) - 1;
    }
    if bits > 0 {
        let pad = 8 - bits;
        dst.push(((acc << pad) | ((1u64 << pad) - 1)) as u8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Codes from RFC 7541, Appendix B: the lengths make the same code.
    #[test]
    fn codes_are_the_rfcs() {
        for (sym, code, len) in [
            (0usize, 0x1ff8u32, 13u8),
            (1, 0x7fffd8, 23),
            (9, 0xffffea, 24),
            (10, 0x3ffffffc, 30),
            (b' ' as usize, 0x14, 6),
            (b'0' as usize, 0x0, 5),
            (b'a' as usize, 0x3, 5),
            (b'{' as usize, 0x7ffe, 15),
            (127, 0xffffffc, 28),
            (255, 0x3ffffee, 26),
            (256, 0x3fffffff, 30),
        ] {
            assert_eq!((CODE.codes[sym], LENGTHS[sym]), (code, len), "symbol {sym}");
        }
    }

    /// RFC 7541, C.4.1 and C.6.1.
    #[test]
    fn rfc_examples() {
        let cases: [(&[u8], &[u8]); 3] = [
            (
                &[
                    0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
                ],
                b"www.example.com",
            ),
            (&[0x64, 0x02], b"302"),
            (
                &[
                    0xd0, 0x7a, 0xbe, 0x94, 0x10, 0x54, 0xd4, 0x44, 0xa8, 0x20, 0x05, 0x95, 0x04,
                    0x0b, 0x81, 0x66, 0xe0, 0x82, 0xa6, 0x2d, 0x1b, 0xff,
                ],
                b"Mon, 21 Oct 2013 20:13:21 GMT",
            ),
        ];
        for (coded, plain) in cases {
            let mut out = Vec::new();
            assert_eq!(decode(coded, &mut out), Ok(()));
            assert_eq!(out, plain);
            let mut back = Vec::new();
            encode(plain, &mut back);
            assert_eq!(back, coded);
        }
    }

    #[test]
    fn every_byte_round_trips() {
        let all: Vec<u8> = (0..=255).collect();
        let mut coded = Vec::new();
        encode(&all, &mut coded);
        let mut out = Vec::new();
        assert_eq!(decode(&coded, &mut out), Ok(()));
        assert_eq!(out, all);
    }

    #[test]
    fn bad_padding_and_eos_are_refused() {
        let mut out = Vec::new();
        // 'a' (00011) then padding 000: not ones.
        assert_eq!(decode(&[0b0001_1000], &mut out), Err(HuffmanError));
        // A whole byte of ones: padding longer than 7 bits.
        assert_eq!(decode(&[0x1f, 0xff], &mut out), Err(HuffmanError));
        // EOS itself (30 ones), then two bits of padding.
        assert_eq!(
            decode(&[0xff, 0xff, 0xff, 0xff], &mut out),
            Err(HuffmanError)
        );
        // Empty is empty.
        out.clear();
        assert_eq!(decode(&[], &mut out), Ok(()));
        assert!(out.is_empty());
    }
}
