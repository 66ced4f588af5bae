//! `make bench-dedup` (its second half): the crate's [`IdSet`] alone — intake's exact
//! duplicate-id check without parsing or the queue — on N ids all distinct, against N ids
//! of which half repeat an earlier one (`cat a a`: the first half again, in order; and the
//! same ids shuffled). Each id is looked up (`candidates`) and, when it has none, inserted,
//! as intake does; confirming a candidate against the stored id is the queue's part and is
//! not timed here. Ids are `row-<i>` strings, made before the clock starts.
//!
//! usage: cargo run --release --example bench_dedup -- [ROWS] [DIR]
//!        (defaults: 1,000,000 rows, a temporary folder for the spill files)
use spool::input::dedup::IdSet;
use std::time::Instant;

/// The ids of one shape, in file order.
fn ids(shape: &str, n: usize) -> Vec<String> {
    let half = n / 2;
    let mut v: Vec<String> = match shape {
        "unique" => (0..n).map(|i| format!("row-{i}")).collect(),
        _ => (0..n).map(|i| format!("row-{}", i % half)).collect(),
    };
    if shape == "shuffled" {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in (1..v.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    v
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(Ok(1_000_000), |a| a.parse())?;
    let tmp = tempfile::tempdir()?;
    let dir = args.next().map_or(tmp.path().to_path_buf(), Into::into);
    println!("IdSet alone, {n} ids");
    println!(
        "{:10} {:>12} {:>8} {:>10} {:>9}",
        "shape", "ids/s", "seconds", "lookups", "vs unique"
    );
    let mut base = None;
    for shape in ["unique", "cat", "shuffled"] {
        let ids = ids(shape, n);
        let mut set = IdSet::new(dir.join(format!("{shape}.ids")));
        let t = Instant::now();
        let mut dups = 0u64;
        for (row, id) in ids.iter().enumerate() {
            if set.candidates(id.as_bytes())?.is_empty() {
                set.insert(id.as_bytes(), row as u64)?;
            } else {
                dups += 1;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let rate = n as f64 / secs;
        let base = *base.get_or_insert(rate);
        println!(
            "{shape:10} {rate:>12.0} {secs:>8.2} {:>10} {:>9.2}   ({dups} duplicates)",
            set.lookups(),
            rate / base
        );
    }
    Ok(())
}
