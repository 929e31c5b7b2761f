//! Property tests of the engine and the Chat Completions dialect.
