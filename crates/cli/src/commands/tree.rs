//! `weightstream cli-tree` (hidden): the command line's own definition as
//! JSON, walked from clap's command tree, so that a test can run every
//! command with hostile values for every argument without a list anyone
//! must remember to update.

use clap::{ArgAction, CommandFactory};

use crate::cli::Cli;
use crate::commands::CliResult;

pub(crate) fn tree() -> CliResult {
    let mut cmd = Cli::command();
    // Built: global arguments (`-v`) propagated into every subcommand,
    // help and version flags added.
    cmd.build();
    let commands: Vec<serde_json::Value> = cmd
        .get_subcommands()
        .map(|sub| {
            let args: Vec<serde_json::Value> = sub.get_arguments().map(arg_json).collect();
            serde_json::json!({
                "name": sub.get_name(),
                "hidden": sub.is_hide_set(),
                "args": args,
            })
        })
        .collect();
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({ "name": cmd.get_name(), "commands": commands }))?
    );
    Ok(())
}

fn arg_json(a: &clap::Arg) -> serde_json::Value {
    let takes_value = matches!(a.get_action(), ArgAction::Set | ArgAction::Append);
    let num_args = a.get_num_args();
    serde_json::json!({
        "id": a.get_id().as_str(),
        "long": a.get_long(),
        "short": a.get_short().map(String::from),
        "positional": a.is_positional(),
        "required": a.is_required_set(),
        "takes_value": takes_value,
        // A flag whose value may be left out (`--iopoll` alone).
        "value_optional": num_args.is_some_and(|n| n.min_values() == 0),
        "value_names": a.get_value_names().map(|v| v.iter().map(|n| n.as_str()).collect::<Vec<_>>()),
        "possible_values": a.get_possible_values().iter().map(|p| p.get_name().to_string()).collect::<Vec<_>>(),
        "action": format!("{:?}", a.get_action()),
        "global": a.is_global_set(),
        "hidden": a.is_hide_set(),
    })
}
