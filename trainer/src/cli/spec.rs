//! The flags of a command as data — keyword name, Python type, help — for the Python package's
//! type hints (`scripts/gen-flags.py` writes `python/kestrel/_flags.py` from them, and a test
//! checks that file against this).

use std::any::TypeId;

use clap::{ArgAction, CommandFactory};

/// One flag of a command.
#[derive(Debug, Clone, PartialEq)]
pub struct FlagSpec {
    /// The keyword argument: `--label-column` is `label_column`.
    pub name: String,
    /// Its Python type: `int`, `float`, `str`, `bool`, `Literal["a", "b"]`, or
    /// `Union[T, Sequence[T]]` for a flag that may repeat.
    pub python: String,
    /// The help line, with the default where there is one.
    pub help: String,
}

/// The visible long flags of `trainer COMMAND` (`None`: no such command), in `--help` order.
pub fn flags_of(command: &str) -> Option<Vec<FlagSpec>> {
    let mut cli = super::Cli::command();
    cli.build();
    let cmd = cli.find_subcommand(command)?;
    Some(
        cmd.get_arguments()
            .filter(|a| !a.is_hide_set() && !a.is_global_set())
            .filter(|a| a.get_long().is_some_and(|l| l != "help" && l != "version"))
            .map(spec)
            .collect(),
    )
}

fn spec(a: &clap::Arg) -> FlagSpec {
    let long = a.get_long().expect("filtered on long flags");
    let possible: Vec<String> = a
        .get_possible_values()
        .iter()
        .filter(|p| !p.is_hide_set())
        .map(|p| format!("{:?}", p.get_name()))
        .collect();
    let one = match a.get_action() {
        ArgAction::SetTrue | ArgAction::SetFalse | ArgAction::Count => "bool".to_string(),
        _ if !possible.is_empty() && !is_bool(a) => format!("Literal[{}]", possible.join(", ")),
        _ => python_type(a).to_string(),
    };
    let python = match a.get_action() {
        ArgAction::Append => format!("Union[{one}, Sequence[{one}]]"),
        _ => one,
    };
    let mut help = a
        .get_help()
        .map(|h| h.to_string())
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ");
    let defaults: Vec<String> = a
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if !defaults.is_empty() && !matches!(a.get_action(), ArgAction::SetTrue | ArgAction::SetFalse) {
        help.push_str(&format!(" [default: {}]", defaults.join(", ")));
    }
    FlagSpec {
        name: long.replace('-', "_"),
        python,
        help,
    }
}

fn is_bool(a: &clap::Arg) -> bool {
    a.get_value_parser().type_id() == TypeId::of::<bool>()
}

fn python_type(a: &clap::Arg) -> &'static str {
    let id = a.get_value_parser().type_id();
    let is = |t: TypeId| id == t;
    let ints = [
        TypeId::of::<usize>(),
        TypeId::of::<u64>(),
        TypeId::of::<u32>(),
        TypeId::of::<u16>(),
        TypeId::of::<u8>(),
        TypeId::of::<i64>(),
        TypeId::of::<i32>(),
    ];
    if ints.into_iter().any(is) {
        "int"
    } else if is(TypeId::of::<f64>()) || is(TypeId::of::<f32>()) {
        "float"
    } else if is(TypeId::of::<bool>()) {
        "bool"
    } else {
        // Paths, names, and what the command parses from text itself (URLs, durations, lists).
        "str"
    }
}

#[cfg(test)]
mod tests {
    use super::flags_of;

    #[test]
    fn fit_flags_carry_their_types() {
        let fit = flags_of("fit").expect("fit exists");
        let ty = |n: &str| {
            fit.iter()
                .find(|f| f.name == n)
                .unwrap_or_else(|| panic!("no flag {n} in {fit:?}"))
                .python
                .clone()
        };
        assert_eq!(ty("epochs"), "int");
        assert_eq!(ty("lr"), "float");
        assert_eq!(ty("no_mlflow"), "bool");
        assert_eq!(ty("label_column"), "str");
        assert!(
            ty("data").starts_with("Union[str, Sequence[str]]"),
            "{}",
            ty("data")
        );
        assert!(fit.iter().all(|f| f.name != "help"));
        assert!(flags_of("no-such-command").is_none());
    }
}
