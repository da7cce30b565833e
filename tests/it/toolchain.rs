//! What building imgpipe needs, as Cargo.toml states it: the `rust-version` is the highest
//! `rust-version` any locked dependency declares (so it is the true minimum, neither a guess
//! too low nor a promise too high), and the licence it names has its files.
//!
//! Only one toolchain is installed where the tests run, so the minimum is checked against the
//! dependencies' own declarations rather than by building with that older compiler.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The value of `key = "…"` in Cargo.toml's `[package]` table.
fn package_field(key: &str) -> String {
    let text = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let package = text.split("\n[").next().unwrap();
    package
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once('=')?;
            (name.trim() == key).then(|| value.trim().trim_matches('"').to_owned())
        })
        .unwrap_or_else(|| panic!("Cargo.toml's [package] has no {key}"))
}

/// A version as numbers, `1.94` and `1.94.0` alike.
fn version(text: &str) -> Vec<u64> {
    let mut parts: Vec<u64> = text.split('.').map(|p| p.parse().unwrap()).collect();
    parts.resize(3, 0);
    parts
}

/// The output of `program args…`, failing with what was run.
fn output(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// This machine's target triple, the `host:` line of `rustc -vV`.
fn host() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    output(&rustc, &["-vV"])
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .expect("rustc -vV names its host")
}

/// The highest `rust-version` of the packages Cargo.lock holds for this platform, and who
/// declares it. Offline: the build already fetched them.
fn highest_dependency_rust_version() -> (Vec<u64>, String) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let host = host();
    let args = ["metadata", "--format-version", "1", "--locked", "--offline"];
    let text = output(&cargo, &[&args[..], &["--filter-platform", &host]].concat());
    let metadata: Value = serde_json::from_str(&text).unwrap();
    metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["name"] != "imgpipe")
        .filter_map(|p| {
            let declared = p["rust_version"].as_str()?;
            Some((
                version(declared),
                format!("{} {} ({declared})", p["name"], p["version"]),
            ))
        })
        .max()
        .expect("some dependency declares a rust-version")
}

#[test]
fn rust_version_is_the_highest_a_locked_dependency_needs() {
    let ours = package_field("rust-version");
    assert!(
        version(&ours) >= version("1.85"),
        "rust-version {ours} is below 1.85, the first Rust with edition 2024"
    );
    let (theirs, who) = highest_dependency_rust_version();
    assert_eq!(
        version(&ours),
        theirs,
        "Cargo.toml's rust-version is {ours}, but the highest any locked dependency needs is {who}: \
         set rust-version to it, and say so in docs/getting-started.md"
    );
    let page = std::fs::read_to_string(root().join("docs/getting-started.md")).unwrap();
    assert!(
        page.contains(&format!("Rust {ours} or later")),
        "docs/getting-started.md does not say \"Rust {ours} or later\""
    );
}

#[test]
fn the_licence_cargo_toml_names_has_its_files() {
    assert_eq!(package_field("license"), "MIT OR Apache-2.0");
    let mit = std::fs::read_to_string(root().join("LICENSE-MIT")).unwrap();
    assert!(
        mit.contains("Permission is hereby granted, free of charge"),
        "LICENSE-MIT"
    );
    let apache = std::fs::read_to_string(root().join("LICENSE-APACHE")).unwrap();
    assert!(
        apache.contains("Apache License\n                        Version 2.0"),
        "LICENSE-APACHE"
    );
}
