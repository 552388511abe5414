//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/*`) through the same checks the
//! cargo-fuzz targets run (`fuzz/src/lib.rs`), so every input the fuzzers kept is checked by
//! `cargo test` on a clean clone, without cargo-fuzz or a nightly toolchain.

#[path = "../../fuzz/src/lib.rs"]
#[allow(unreachable_pub)]
mod checks;

use std::path::Path;

/// Runs `check` on every file of `fuzz/corpus/<target>`; returns how many there were.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a corpus entry").path();
        let data = std::fs::read(&path).expect("a corpus file");
        let outcome = std::panic::catch_unwind(|| check(&data));
        assert!(
            outcome.is_ok(),
            "{target}: {} fails its check",
            path.display()
        );
        n += 1;
    }
    n
}

macro_rules! corpus {
    ($($target:ident),* $(,)?) => {$(
        #[test]
        fn $target() {
            let n = replay(stringify!($target), checks::$target);
            assert!(n >= 5, "the {} corpus has only {n} inputs", stringify!($target));
        }
    )*};
}

corpus!(
    key_header,
    retry_after,
    grpc_timeout,
    grpc_status_message,
    grpc_pushback,
    scope_encoding,
    record_decode,
);
