//! Compiles the loadtest's proto with protox (pure Rust), as `examples/tonic-library` does: no
//! system `protoc` needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/bench/v1/orders.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    // `bytes` fields as `Bytes`: the handler answers a static body without copying it, as the
    // HTTP handler does.
    tonic_prost_build::configure().bytes(".").compile_fds(fds)?;
    Ok(())
}
