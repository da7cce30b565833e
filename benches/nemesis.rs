//! `cargo bench --bench nemesis -- --trials N --seed S [--json] [--mutate NAME]
//! [--list-mutations] [--backend sqlite|postgres|both] [--keep] [--max-items N] [--jobs J]
//! [--from A --to B]`: the fault campaign of issue 43 (benches/nemesis/). Exit 0 when no trial
//! violated an invariant, 1 otherwise.

#[path = "nemesis/mod.rs"]
mod nemesis;

fn main() {
    let binary = std::env::var("IMGPIPE_BENCH_BINARY")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_imgpipe").to_owned());
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(nemesis::main(&binary, &args));
}
