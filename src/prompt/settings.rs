//! The config's prompt settings checked against the prompt stage itself: the parser names
//! `[tokenizer]` gives, and each dataset's draw (sampling lists and tables, template
//! variables, `reasoning`), which only [`Drawer`] can judge.
//!
//! Invariant: a failure is the [`ConfigError::Invalid`] `Config::load` would give for it,
//! naming the file and the key (exit code 2); a run calls [`check`] before it writes
//! anything, so `Config` itself needs nothing of this stage.

use crate::config::{Config, ConfigError};
use crate::prompt::draw::Drawer;
use crate::prompt::syntax::{REASONING_PARSERS, TOOL_PARSERS};

/// Refuses a config whose parser names this spool does not know, or a dataset whose draw
/// cannot be made (the first such key, in file order).
pub fn check(cfg: &Config) -> Result<(), ConfigError> {
    if let Some(t) = &cfg.tokenizer {
        for (key, name, known) in [
            (
                "tokenizer.reasoning_parser",
                &t.reasoning_parser,
                REASONING_PARSERS,
            ),
            ("tokenizer.tool_parser", &t.tool_parser, TOOL_PARSERS),
        ] {
            if let Some(n) = name.as_deref().filter(|n| !known.contains(n)) {
                return Err(cfg.invalid(
                    key,
                    format!("unknown parser `{n}`; known: {}", known.join(", ")),
                ));
            }
        }
    }
    for (i, d) in cfg.datasets.iter().enumerate() {
        if let Err(why) = Drawer::of_dataset(cfg, d) {
            let key = why.split(':').next().unwrap_or_default();
            return Err(cfg.invalid(
                &format!("dataset[{i}].{key}"),
                format!("dataset `{}`: {why}", d.name),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Overrides;

    /// The config as a run sees it: loaded, then checked here.
    fn checked(text: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("spool.toml");
        std::fs::write(&p, text).unwrap();
        let cfg = Config::load(&p, &Overrides::default())?;
        check(&cfg)?;
        Ok(cfg)
    }

    /// An unknown parser name is refused before a run, naming the key and listing the names
    /// it takes; a known one loads.
    #[test]
    fn parser_names_are_checked() {
        let cfg = |k: &str, v: &str| {
            format!(
                "[server]\nurls=['http://127.0.0.1:1']\n[tokenizer]\npath='t.json'\n{k} = '{v}'\n\
                 [[dataset]]\nname='a'\npath='a.jsonl'\n"
            )
        };
        let e = checked(&cfg("tool_parser", "kimi"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer.tool_parser") && e.contains("kimi_k2, minimax-m2"),
            "{e}"
        );
        let e = checked(&cfg("reasoning_parser", "glm4"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer.reasoning_parser") && e.contains("glm45"),
            "{e}"
        );
        let ok = checked(&cfg("reasoning_parser", "kimi_k2")).unwrap();
        assert_eq!(
            ok.tokenizer.unwrap().reasoning_parser.as_deref(),
            Some("kimi_k2")
        );
    }

    /// A dataset's draw that cannot be made (a zero weight, thinking both off and on) is
    /// refused naming the dataset, the key under it and the file.
    #[test]
    fn draws_are_checked() {
        let base =
            "[server]\nurls = ['http://127.0.0.1:1']\n[[dataset]]\nname='a'\npath='a.jsonl'\n";
        for (extra, key) in [
            (
                "chat_template_kwargs = { effort = { low = 0 } }\n",
                "dataset[0].chat_template_kwargs.effort",
            ),
            (
                "reasoning = 'disable'\nchat_template_kwargs = { enable_thinking = true }\n",
                "enable_thinking",
            ),
        ] {
            let e = checked(&format!("{base}{extra}")).unwrap_err().to_string();
            assert!(
                e.contains(key) && e.contains("dataset `a`") && e.contains("spool.toml"),
                "{extra}: {e}"
            );
        }
        checked(&format!(
            "{base}chat_template_kwargs = {{ effort = {{ low = 4 }} }}\n"
        ))
        .unwrap();
    }
}
