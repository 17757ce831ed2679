//! mbal-server (under construction)
