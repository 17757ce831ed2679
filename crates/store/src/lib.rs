//! mbal-store (under construction)
