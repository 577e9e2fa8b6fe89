//! Metric plots (being written).
