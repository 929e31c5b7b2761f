//! Shell command lines split into simple commands, for file tracking.
//!
//! Not a shell: just enough of POSIX syntax to find the words and redirections of each simple
//! command in what agents typically run. Separators are `;`, `&&`, `||`, `|`, `&`, newlines and
//! parentheses; single and double quotes and backslashes are honoured; comments and heredoc
//! bodies are skipped; `>`, `>>`, `&>`, `N>` and `<` become redirections (`>&2` is not a file).
//! Anything it does not understand degrades to extra or missing words, never to an error.

/// What a redirection does with its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redirect {
    /// `>`, `>>`, `&>`: the target is written.
    Out,
    /// `<`: the source is read.
    In,
}

/// One simple command: its words (quotes removed) and redirections.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SimpleCommand {
    /// The words, quotes removed.
    pub words: Vec<String>,
    /// Redirections and their targets.
    pub redirects: Vec<(Redirect, String)>,
}

/// Splits a shell command line into simple commands: separators `;`, `&&`, `||`, `|`, `&`,
/// newlines and parentheses; quotes and backslashes are honoured; heredoc bodies and comments
/// are skipped; `>`, `>>`, `&>`, `N>` and `<` become redirections.
pub fn split_commands(cmd: &str) -> Vec<SimpleCommand> {
    #[derive(PartialEq)]
    enum Expect {
        Word,
        Target(Redirect),
        HeredocDelimiter,
        HereString,
    }
    let mut out = Vec::new();
    let mut current = SimpleCommand::default();
    let mut word = String::new();
    let mut in_word = false;
    let mut expect = Expect::Word;
    let mut heredocs: Vec<String> = Vec::new();
    let chars: Vec<char> = cmd.chars().collect();
    let mut i = 0;

    fn finish_word(
        word: &mut String,
        in_word: &mut bool,
        expect: &mut Expect,
        current: &mut SimpleCommand,
        heredocs: &mut Vec<String>,
    ) {
        if !*in_word {
            return;
        }
        let w = std::mem::take(word);
        *in_word = false;
        match std::mem::replace(expect, Expect::Word) {
            Expect::Word => current.words.push(w),
            Expect::Target(kind) => current.redirects.push((kind, w)),
            Expect::HeredocDelimiter => heredocs.push(w.trim_start_matches('-').to_string()),
            Expect::HereString => {}
        }
    }

    while let Some(&c) = chars.get(i) {
        match c {
            '\'' => {
                in_word = true;
                i += 1;
                while let Some(&d) = chars.get(i) {
                    i += 1;
                    if d == '\'' {
                        break;
                    }
                    word.push(d);
                }
                continue;
            }
            '"' => {
                in_word = true;
                i += 1;
                while let Some(&d) = chars.get(i) {
                    i += 1;
                    match d {
                        '"' => break,
                        '\\' => {
                            if let Some(&e) = chars.get(i) {
                                i += 1;
                                if !matches!(e, '"' | '\\' | '$' | '`') {
                                    word.push('\\');
                                }
                                word.push(e);
                            }
                        }
                        _ => word.push(d),
                    }
                }
                continue;
            }
            '\\' => {
                if let Some(&e) = chars.get(i + 1) {
                    if e != '\n' {
                        in_word = true;
                        word.push(e);
                    }
                }
                i += 2;
                continue;
            }
            '#' if !in_word => {
                while chars.get(i).is_some_and(|&d| d != '\n') {
                    i += 1;
                }
                continue;
            }
            ' ' | '\t' | '\r' => finish_word(
                &mut word,
                &mut in_word,
                &mut expect,
                &mut current,
                &mut heredocs,
            ),
            '\n' | ';' | '|' | '&' | '(' | ')' => {
                if c == '&' && chars.get(i + 1) == Some(&'>') {
                    // `&>file` / `&>>file`
                    finish_word(
                        &mut word,
                        &mut in_word,
                        &mut expect,
                        &mut current,
                        &mut heredocs,
                    );
                    i += 2;
                    if chars.get(i) == Some(&'>') {
                        i += 1;
                    }
                    expect = Expect::Target(Redirect::Out);
                    continue;
                }
                finish_word(
                    &mut word,
                    &mut in_word,
                    &mut expect,
                    &mut current,
                    &mut heredocs,
                );
                out.push(std::mem::take(&mut current));
                expect = Expect::Word;
                if c == '\n' && !heredocs.is_empty() {
                    // Skip heredoc bodies up to their delimiter lines.
                    i += 1;
                    for delim in std::mem::take(&mut heredocs) {
                        while i < chars.len() {
                            let start = i;
                            while chars.get(i).is_some_and(|&d| d != '\n') {
                                i += 1;
                            }
                            let line: String =
                                chars.get(start..i).unwrap_or_default().iter().collect();
                            i += 1;
                            if line.trim() == delim {
                                break;
                            }
                        }
                    }
                    continue;
                }
            }
            '>' => {
                // A word of digits right before `>` is a file descriptor.
                if in_word && word.bytes().all(|b| b.is_ascii_digit()) {
                    word.clear();
                    in_word = false;
                } else {
                    finish_word(
                        &mut word,
                        &mut in_word,
                        &mut expect,
                        &mut current,
                        &mut heredocs,
                    );
                }
                i += 1;
                if chars.get(i) == Some(&'>') {
                    i += 1;
                }
                if chars.get(i) == Some(&'&') {
                    // `>&2`: duplicates a descriptor, no file.
                    i += 1;
                    while chars
                        .get(i)
                        .is_some_and(|d| d.is_ascii_digit() || *d == '-')
                    {
                        i += 1;
                    }
                    continue;
                }
                expect = Expect::Target(Redirect::Out);
                continue;
            }
            '<' => {
                finish_word(
                    &mut word,
                    &mut in_word,
                    &mut expect,
                    &mut current,
                    &mut heredocs,
                );
                i += 1;
                if chars.get(i) == Some(&'<') {
                    i += 1;
                    if chars.get(i) == Some(&'<') {
                        i += 1;
                        expect = Expect::HereString;
                    } else {
                        expect = Expect::HeredocDelimiter;
                    }
                } else {
                    expect = Expect::Target(Redirect::In);
                }
                continue;
            }
            _ => {
                in_word = true;
                word.push(c);
            }
        }
        i += 1;
    }
    finish_word(
        &mut word,
        &mut in_word,
        &mut expect,
        &mut current,
        &mut heredocs,
    );
    out.push(current);
    out.retain(|c| !c.words.is_empty() || !c.redirects.is_empty());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unterminated_heredocs_and_escapes_are_safe() {
        for cmd in [
            "cat <<A <<B\nbody",
            "cat <<A\n",
            "echo \\",
            "x <<",
            "a >",
            "'open",
            "\"x\\",
        ] {
            let _ = split_commands(cmd);
        }
        let parts = split_commands("cat <<A <<B\nbody\nA\nmore\nB\ntouch after.txt");
        assert_eq!(
            parts.last().map(|c| c.words.clone()),
            Some(vec!["touch".into(), "after.txt".into()])
        );
    }

    #[test]
    fn words_quotes_and_redirections() {
        let parts = split_commands("grep -n \"a b\" 'x y.txt' > out.log 2>&1 && cat < in.txt | wc");
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0].words, vec!["grep", "-n", "a b", "x y.txt"]);
        assert_eq!(
            parts[0].redirects,
            vec![(Redirect::Out, "out.log".to_string())]
        );
        assert_eq!(
            parts[1].redirects,
            vec![(Redirect::In, "in.txt".to_string())]
        );
        assert_eq!(parts[2].words, vec!["wc"]);
    }
}
