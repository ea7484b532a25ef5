//! Reader (to be written).
