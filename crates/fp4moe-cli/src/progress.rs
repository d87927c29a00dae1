//! Progress display: a spinner with elapsed time on stderr for steps that may take over a
//! second (hidden automatically when stderr is not a terminal).

use indicatif::{ProgressBar, ProgressStyle};
use std::time::Duration;

/// Runs `f` under a spinner labelled `msg`.
pub(crate) fn step<T>(msg: &str, f: impl FnOnce() -> T) -> T {
    let pb = ProgressBar::new_spinner();
    if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
        pb.set_style(style);
    }
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(Duration::from_millis(100));
    let out = f();
    pb.finish_and_clear();
    out
}
