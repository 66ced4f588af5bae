//! NumPy `.npy` files (format version 1.0), what `numpy.load` reads and speculators'
//! training loads its vocabulary mapping from (`d2t-N.npy`, `t2d-N.npy`).
//!
//! The format (numpy.lib.format): the magic `\x93NUMPY`, version bytes 1 and 0, a
//! little-endian u16 header length, then an ASCII Python dict literal
//! `{'descr': '<i8', 'fortran_order': False, 'shape': (N,), }` padded with spaces and ended
//! by `\n` so that the data starts at a multiple of 64 bytes, then the array's bytes in C
//! order.
//!
//! Invariant: only one-dimensional arrays of the two dtypes spool writes (`<i8`, `|b1`);
//! the header always fits the u16 length of version 1.0.

/// An array's element type and its bytes.
pub enum Array<'a> {
    /// int64, written little-endian (`<i8`).
    I64(&'a [i64]),
    /// bool, one byte each, 0 or 1 (`|b1`).
    Bool(&'a [bool]),
}

impl Array<'_> {
    fn descr(&self) -> &'static str {
        match self {
            Array::I64(_) => "<i8",
            Array::Bool(_) => "|b1",
        }
    }

    fn len(&self) -> usize {
        match self {
            Array::I64(v) => v.len(),
            Array::Bool(v) => v.len(),
        }
    }
}

/// The `.npy` bytes of a one-dimensional `array`.
pub fn encode(array: &Array<'_>) -> Vec<u8> {
    let mut header = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': ({},), }}",
        array.descr(),
        array.len()
    );
    // magic (6) + version (2) + length (2) + header + '\n', padded to 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + array.len() * 8);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    // A few dozen bytes: always within u16.
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    match array {
        Array::I64(v) => {
            for x in *v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes `numpy.save(f, np.array([1, -2], dtype=np.int64))` writes (numpy 2.x),
    /// and a bool array's header: the data starts on a 64-byte boundary.
    #[test]
    fn bytes_are_numpys() {
        let b = encode(&Array::I64(&[1, -2]));
        let mut want =
            b"\x93NUMPY\x01\x00\x76\x00{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }"
                .to_vec();
        want.resize(127, b' ');
        want.push(b'\n');
        want.extend_from_slice(&1i64.to_le_bytes());
        want.extend_from_slice(&(-2i64).to_le_bytes());
        assert_eq!(b, want);
        let b = encode(&Array::Bool(&[true, false, true]));
        assert_eq!(b.len(), 128 + 3);
        assert!(b.starts_with(
            b"\x93NUMPY\x01\x00\x76\x00{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }"
        ));
        assert_eq!(&b[128..], &[1, 0, 1]);
        assert_eq!(b[127], b'\n');
    }
}
