//! Prompt datasets (being written).
