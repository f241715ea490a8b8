//! Pure planning of one read, before any I/O: the aligned window (EOF
//! clamp, payload in place), its chunks and what a chunk's completion
//! means, and the direct/buffered decision the synchronous read and the
//! engine share.

pub(crate) mod chunk;
pub(crate) mod direct;
pub(crate) mod placement;
pub(crate) mod window;
