//! mbal-bench (under construction)
