//! The shared library's soname: `libweightstream.so.<ABI major>`, so a
//! program linked against ABI 1 never loads an ABI 2 library by accident.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libweightstream.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
