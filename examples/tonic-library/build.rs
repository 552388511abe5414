//! Compiles the proto with protox (pure Rust): no system `protoc` needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/plume/linkd/v3/library.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
