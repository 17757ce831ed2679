//! mbal-proto (under construction)
