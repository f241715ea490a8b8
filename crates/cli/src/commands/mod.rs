//! One module per command.

pub(crate) mod bench;
pub(crate) mod ceiling;
pub(crate) mod demo;
pub(crate) mod digest;
pub(crate) mod gen;
pub(crate) mod inspect;
pub(crate) mod load;
pub(crate) mod load_ceiling;
pub(crate) mod place;
pub(crate) mod plot;
pub(crate) mod tree;
pub(crate) mod verify;

/// What a command returns: any error is printed with its causes.
pub(crate) type CliResult = Result<(), Box<dyn std::error::Error>>;
