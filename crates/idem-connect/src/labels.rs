//! Metric labels whose values a client chooses (an action, an error class, a workflow
//! name): bounded, so a client cannot grow the exporter's memory without bound.

use std::sync::{Mutex, OnceLock};

/// Most distinct values a client-chosen label (action, error class) gets; later ones are
/// reported as `other`, so a client cannot grow the exporter's memory without bound.
pub const MAX_LABEL_VALUES: usize = 100;

/// `value` if it is one of the first [`MAX_LABEL_VALUES`] values seen for `family`, else
/// `other`.
pub fn bounded_label(family: &'static str, value: &str) -> String {
    static SEEN: OnceLock<Mutex<std::collections::HashMap<&'static str, std::collections::HashSet<String>>>> =
        OnceLock::new();
    let mut seen = SEEN.get_or_init(Default::default).lock().expect("label set lock");
    let set = seen.entry(family).or_default();
    if set.contains(value) || (set.len() < MAX_LABEL_VALUES && set.insert(value.to_owned())) {
        value.to_owned()
    } else {
        "other".to_owned()
    }
}
