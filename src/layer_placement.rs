//! Layer striping for trainers that stream whole decoder layers: layer `i`
//! lives on root `i mod N` (root 0 is the primary), so consecutive layers
//! come from different drives, and `N + 1` layers in flight keep every
//! drive busy while the trainer computes on the current one.
//!
//! The roots are ordinary split directories: open the model with the
//! primary and `dirs = roots[1..]`, and the engine reads each layer from the
//! drive it was placed on (mirrors, if any, still spread the chunks).

use std::path::PathBuf;

/// Most layers kept in flight by default, however many roots there are.
pub const MAX_READAHEAD: usize = 8;

/// The root each of `layers` layers is placed on: layer `i` -> `roots[i % N]`.
pub fn placement(layers: usize, roots: &[PathBuf]) -> Vec<PathBuf> {
    if roots.is_empty() {
        return Vec::new();
    }
    (0..layers).map(|i| roots[i % roots.len()].clone()).collect()
}

/// The read-ahead a trainer should use with `roots` striped roots when it
/// left the default: `N + 1` layers in flight, at most [`MAX_READAHEAD`].
pub fn readahead_default(roots: usize) -> usize {
    (roots + 1).clamp(1, MAX_READAHEAD)
}

/// The decoder layer a tensor name belongs to (`...layers.{L}...`), if any.
pub fn layer_of(name: &str) -> Option<usize> {
    crate::format::catalog::index_after(name, "layers.").map(|l| l as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_round_robin_over_roots() {
        let roots: Vec<PathBuf> = ["/a", "/b", "/c"].iter().map(PathBuf::from).collect();
        let p = placement(7, &roots);
        let names: Vec<&str> = p.iter().map(|x| x.to_str().unwrap()).collect();
        assert_eq!(names, ["/a", "/b", "/c", "/a", "/b", "/c", "/a"]);
        assert!(placement(3, &[]).is_empty());
    }

    #[test]
    fn readahead_is_n_plus_one_capped() {
        assert_eq!(readahead_default(1), 2);
        assert_eq!(readahead_default(2), 3);
        assert_eq!(readahead_default(6), 7);
        assert_eq!(readahead_default(7), 8);
        assert_eq!(readahead_default(12), 8);
    }

    #[test]
    fn layer_numbers_parse() {
        assert_eq!(layer_of("model.layers.12.mlp.experts.3.up_proj.weight"), Some(12));
        assert_eq!(layer_of("model.embed_tokens.weight"), None);
    }
}
