//! What the caller asks for: how to open a model ([`ModelConfig`]: the
//! directories, mirrors, weights, route policy, O_DIRECT mode) and how to
//! run an engine ([`EngineConfig`]), from builders or from the one table of
//! `WEIGHTSTREAM_*` variables ([`env`]).

pub(crate) mod engine;
pub mod env;
pub(crate) mod model;

pub use engine::{BackendChoice, EngineConfig, IoPoll, SubmitMode, DEFAULT_SLICE_STAGING};
pub(crate) use model::MAX_COPY_RANKS;
pub use model::{split_list, DirectMode, ModelConfig, RoutePolicy, Weights};

/// Parses one of a fixed set of words (case and surrounding blanks
/// ignored): `table` lists each value with the words that name it, the
/// first being the one the error suggests ("route \"x\": expected hash,
/// stripe or adaptive").
pub(crate) fn parse_word<T: Copy>(what: &str, s: &str, table: &[(&[&str], T)]) -> crate::error::Result<T> {
    let t = s.trim().to_ascii_lowercase();
    if let Some((_, v)) = table.iter().find(|(words, _)| words.contains(&t.as_str())) {
        return Ok(*v);
    }
    let names: Vec<&str> = table.iter().map(|(words, _)| words[0]).collect();
    let expected = match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => names.join(""),
    };
    Err(crate::error::Error::Config(format!(
        "{what} {t:?}: expected {expected}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_parse_case_blind_and_errors_list_the_first_names() {
        assert_eq!(" Stripe ".parse::<RoutePolicy>().unwrap(), RoutePolicy::Stripe);
        assert_eq!("io-uring".parse::<BackendChoice>().unwrap(), BackendChoice::Uring);
        assert_eq!("TRUE".parse::<IoPoll>().unwrap(), IoPoll::Auto);
        assert_eq!("0".parse::<DirectMode>().unwrap(), DirectMode::Off);
        let e = "fast".parse::<RoutePolicy>().unwrap_err().to_string();
        assert_eq!(e, "route \"fast\": expected hash, stripe or adaptive");
        let e = "x".parse::<IoPoll>().unwrap_err().to_string();
        assert_eq!(e, "iopoll \"x\": expected off, auto or force");
    }
}
