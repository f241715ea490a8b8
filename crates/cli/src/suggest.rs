//! What to say when a tensor filter matches no name: the names closest to
//! it, or else the name parts the model does have, each with how many
//! tensors it would match. A user who typed `.experts.` against a dense
//! model learns `.mlp.` from the error instead of from `inspect`.

use std::collections::BTreeMap;

/// The most names or parts a hint lists.
const MAX_SHOWN: usize = 5;

/// A hint for `filter` (a substring that matched none of `names`), to
/// append to the error: "; names like it: ..." when some name matches it
/// ignoring case, or holds most of its words (split at `.` and `_`);
/// else "; its tensors' names have ..." with the parts the names have
/// (as the filters that find them), the most common first, each with the
/// number of names that filter matches.
/// Empty when the model has no tensors.
pub(crate) fn no_match_hint<'a>(filter: &str, names: impl IntoIterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.into_iter().collect();
    if names.is_empty() {
        return String::new();
    }
    let lower = filter.to_lowercase();
    let words: Vec<String> = lower
        .split(['.', '_'])
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect();
    // Each name's score: a match ignoring case beats every word count.
    let mut scored: Vec<(usize, &str)> = names
        .iter()
        .filter_map(|&n| {
            let l = n.to_lowercase();
            if !lower.is_empty() && l.contains(&lower) {
                return Some((usize::MAX, n));
            }
            let hits = words.iter().filter(|w| l.contains(w.as_str())).count();
            // Most of the filter's words (all of one, two of three).
            (hits > 0 && 2 * hits >= words.len()).then_some((hits, n))
        })
        .collect();
    if !scored.is_empty() {
        scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
        let shown: Vec<String> = scored.iter().take(MAX_SHOWN).map(|(_, n)| format!("{n:?}")).collect();
        let more = scored.len().saturating_sub(MAX_SHOWN);
        return format!(
            "; names like it: {}{}",
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
    }
    // The dotted parts that are words (not layer or expert numbers), by
    // how many names hold them.
    let mut parts: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &names {
        let mut seen: Vec<&str> = Vec::new();
        for p in n.split('.') {
            if p.is_empty() || p.bytes().all(|b| b.is_ascii_digit()) || seen.contains(&p) {
                continue;
            }
            seen.push(p);
            *parts.entry(p).or_default() += 1;
        }
    }
    let mut parts: Vec<(&str, usize)> = parts.into_iter().collect();
    parts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    // The parts every name has (`model`, `weight`) say nothing. Each is
    // shown as the filter that finds it, with the count that filter
    // matches: `.part.` where it is never a name's first or last part,
    // else the bare word.
    let telling: Vec<String> = parts
        .iter()
        .filter(|(_, c)| *c < names.len())
        .take(MAX_SHOWN)
        .map(|&(p, c)| {
            let dotted = format!(".{p}.");
            if names.iter().filter(|n| n.contains(&dotted)).count() == c {
                format!("{dotted:?} ({c})")
            } else {
                format!("{p:?} ({})", names.iter().filter(|n| n.contains(p)).count())
            }
        })
        .collect();
    if telling.is_empty() {
        return format!("; its tensors are named like {:?}", names[0]);
    }
    format!("; its tensors' names have {}", telling.join(", "))
}

#[cfg(test)]
mod tests {
    use super::no_match_hint;

    const DENSE: &[&str] = &[
        "model.embed_tokens.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.norm.weight",
    ];

    #[test]
    fn a_case_slip_names_the_tensors() {
        let h = no_match_hint("Embed_Tokens", DENSE.iter().copied());
        assert_eq!(h, "; names like it: \"model.embed_tokens.weight\"");
    }

    #[test]
    fn words_of_the_filter_find_names_most_first() {
        let h = no_match_hint("layers.1.mlp.up", DENSE.iter().copied());
        // layers, 1, mlp: three of four words in layer 1's mlp names.
        assert!(
            h.starts_with(
                "; names like it: \"model.layers.1.mlp.down_proj.weight\", \"model.layers.1.mlp.gate_proj.weight\""
            ),
            "{h}"
        );
    }

    #[test]
    fn experts_on_a_dense_model_get_the_parts_it_has() {
        let h = no_match_hint(".experts.", DENSE.iter().copied());
        assert_eq!(
            h,
            "; its tensors' names have \".layers.\" (6), \".mlp.\" (4), \".down_proj.\" (2), \".gate_proj.\" (2), \
             \".q_proj.\" (2)"
        );
        assert_eq!(no_match_hint("x", std::iter::empty()), "");
        assert_eq!(
            no_match_hint("x", ["a.weight", "b.weight"].into_iter()),
            "; its tensors' names have \"a\" (1), \"b\" (1)"
        );
    }
}
