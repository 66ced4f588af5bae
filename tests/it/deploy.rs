//! The deployment files: `deploy/kubernetes` (strict schema validation with the bundled
//! schemas of `kubernetes-validate`, and the numbers that must agree between the Job, its
//! ConfigMap and spool's own config loader), `deploy/slurm` (the scripts parse, the array
//! matches the partitions, `submit.sh` chains finalize with afterok, and a SIGTERM to an array
//! task's shell stops the real spool gracefully and requeues the task), `deploy/systemd`
//! (`systemd-analyze verify`), the `Dockerfile`, and a local simulation of the Indexed Job:
//! four real `spool` processes with `JOB_COMPLETION_INDEX` 0..3 and the Job's own arguments.
//!
//! Needs `python3` with PyYAML and the `kubernetes-validate` package (pip), and systemd's
//! `systemd-analyze`; no network, no cluster, no Docker.

use crate::process::{edit_config, mock_log, Proc};
use crate::support::{spool_bin, write_config, write_prompts, Ds, Mock};
use serde_json::Value;
use spool::mock::MockConfig;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn k8s_dir() -> PathBuf {
    root().join("deploy/kubernetes")
}

fn slurm_dir() -> PathBuf {
    root().join("deploy/slurm")
}

/// `name` on PATH, or a failure that says how to install it.
fn tool(name: &str, install: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("`{name}` is not on PATH: {install}"))
}

/// Every YAML document of a file, as JSON (PyYAML's safe loader, as kubectl reads YAML 1.1).
fn yaml_docs(path: &Path) -> Vec<Value> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; json.dump(list(yaml.safe_load_all(open(sys.argv[1]))), sys.stdout)",
        ])
        .arg(path)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "reading {} as YAML (needs PyYAML, which kubernetes-validate brings): {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The one document of a manifest.
fn manifest(name: &str) -> Value {
    let mut docs = yaml_docs(&k8s_dir().join(name));
    assert_eq!(docs.len(), 1, "{name} holds one object");
    docs.remove(0)
}

/// The `spool.toml` of the ConfigMap.
fn configmap_toml() -> (String, toml::Table) {
    let cm = manifest("configmap.yaml");
    assert_eq!(cm["kind"], "ConfigMap");
    let text = cm["data"]["spool.toml"]
        .as_str()
        .expect("the ConfigMap holds spool.toml")
        .to_string();
    let table: toml::Table = toml::from_str(&text).unwrap();
    (text, table)
}

fn int(v: &Value, what: &str) -> i64 {
    v.as_i64()
        .unwrap_or_else(|| panic!("{what} is not an integer: {v}"))
}

/// The port of a `host:port` address.
fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {addr}"))
}

/// The container named `name` of a Job's pod template.
fn container<'a>(job: &'a Value, name: &str) -> &'a Value {
    job["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name} in {}", job["metadata"]["name"]))
}

/// The value after `flag` in an argument list.
fn flag_value<'a>(args: &'a [Value], flag: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    args[i + 1].as_str().unwrap()
}

/// The volume mounted at the folder holding `file` in `c`, looked up in the pod's volumes.
fn volume_at<'a>(job: &'a Value, c: &Value, dir: &str) -> &'a Value {
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == dir)
        .unwrap_or_else(|| panic!("nothing mounted at {dir} in {}", c["name"]));
    job["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("no volume {}", mount["name"]))
}

// ---------------------------------------------------------------------------------------
// Kubernetes

/// The Kubernetes versions the manifests are validated against: 1.31 is the oldest whose
/// schemas know every field used (backoffLimitPerIndex, podFailurePolicy's FailIndex, native
/// sidecars); 1.33 is where backoffLimitPerIndex and sidecars are GA.
const K8S_VERSIONS: [&str; 2] = ["1.31.0", "1.33.0"];

fn kubernetes_validate(files: &[PathBuf], version: &str) -> std::process::Output {
    let kv = tool(
        "kubernetes-validate",
        "pip install kubernetes-validate (it bundles the schemas and works offline)",
    );
    Command::new(kv)
        .args(["--strict", "-k", version])
        .args(files)
        .output()
        .unwrap()
}

/// Every manifest under `deploy/kubernetes` passes `kubernetes-validate --strict` (unknown
/// fields are errors) against Kubernetes 1.31 and 1.33; the kustomization lists exactly the
/// objects that start a run; and the same validator rejects a copy of the Job with a
/// misspelt field, so strict mode really is on.
#[test]
fn kubernetes_manifests_pass_strict_schema_validation() {
    let dir = k8s_dir();
    let manifests: Vec<PathBuf> = [
        "configmap.yaml",
        "job.yaml",
        "finalize-job.yaml",
        "secret.example.yaml",
    ]
    .iter()
    .map(|f| dir.join(f))
    .collect();
    // No YAML in the folder escapes validation.
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = manifests
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    listed.sort();
    assert_eq!(on_disk, listed, "every manifest is validated");

    for version in K8S_VERSIONS {
        let out = kubernetes_validate(&manifests, version);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "Kubernetes {version}:\n{text}");
        for m in &manifests {
            let line = format!("{} passed", m.display());
            assert!(text.contains(&line), "no `{line}` for {version}:\n{text}");
        }
        assert!(!text.contains("ERROR"), "{text}");
    }

    // Strict mode rejects what a typo would silently drop.
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("job.yaml");
    let text = std::fs::read_to_string(dir.join("job.yaml")).unwrap();
    assert!(text.contains("  parallelism: "));
    std::fs::write(&bad, text.replacen("  parallelism: ", "  paralelism: ", 1)).unwrap();
    let out = kubernetes_validate(&[bad], K8S_VERSIONS[0]);
    assert!(!out.status.success(), "a misspelt field passed");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("'paralelism' was unexpected"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // `kubectl apply -k` starts the run: the ConfigMap and the Job, not the finalize Job
    // (which would fail before the run ends) nor the example Secret (credentials).
    let kust = manifest("kustomization.yaml");
    assert_eq!(kust["kind"], "Kustomization");
    let resources: Vec<&str> = kust["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    assert_eq!(resources, ["configmap.yaml", "job.yaml"]);
    let image = container(&manifest("job.yaml"), "spool")["image"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        format!("{}:", kust["images"][0]["name"].as_str().unwrap()),
        image[..=image.rfind(':').unwrap()],
        "the kustomization's image is the Job's"
    );
}

/// The Job and its ConfigMap agree: completions == parallelism == `[run] partitions`, one
/// index per pod with per-index retries; the scrape annotation's port is `metrics_addr`'s;
/// the grace period outlasts `shutdown_grace_s`; `data_dir` is the pod's own volume; the
/// config is mounted where `-c` points; S3 credentials come from the example Secret's name
/// and keys; the finalize Job runs `spool finalize` with the same ConfigMap and Secret.
#[test]
fn kubernetes_job_matches_its_configmap() {
    let (_, cfg) = configmap_toml();
    let run = cfg["run"].as_table().unwrap();
    let partitions = run["partitions"].as_integer().expect("[run] partitions");
    assert_eq!(partitions, 4);
    let output_dir = cfg["output_dir"].as_str().unwrap();
    assert!(output_dir.starts_with("s3://"), "{output_dir}");
    assert_eq!(cfg["data_dir"].as_str(), Some("/data"));
    // The config binds loopback; the Job overrides it with the pod's IP (from the
    // downward API), which Prometheus scrapes; never every interface.
    let config_addr: std::net::SocketAddr = run["metrics_addr"].as_str().unwrap().parse().unwrap();
    assert!(config_addr.ip().is_loopback(), "{config_addr}");
    let job = manifest("job.yaml");
    let spool_c = container(&job, "spool");
    let metrics_addr = flag_value(spool_c["args"].as_array().unwrap(), "--metrics-addr");
    assert_eq!(metrics_addr, format!("$(POD_IP):{}", config_addr.port()));
    let pod_ip = spool_c["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "POD_IP")
        .expect("POD_IP in the spool container's env");
    assert_eq!(pod_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
    let grace = run["shutdown_grace_s"]
        .as_integer()
        .map(|g| g as f64)
        .or_else(|| run["shutdown_grace_s"].as_float())
        .unwrap();

    let spec = &job["spec"];
    assert_eq!(job["kind"], "Job");
    assert_eq!(spec["completionMode"], "Indexed");
    assert_eq!(int(&spec["completions"], "completions"), partitions);
    assert_eq!(int(&spec["parallelism"], "parallelism"), partitions);
    assert!(int(&spec["backoffLimitPerIndex"], "backoffLimitPerIndex") >= 1);
    let max_failed = int(&spec["maxFailedIndexes"], "maxFailedIndexes");
    assert!((0..=partitions).contains(&max_failed));
    let pod = &spec["template"]["spec"];
    assert_eq!(
        pod["restartPolicy"], "Never",
        "podFailurePolicy needs Never"
    );
    let tgp = int(&pod["terminationGracePeriodSeconds"], "grace period") as f64;
    assert!(
        tgp > grace,
        "terminationGracePeriodSeconds {tgp} must outlast shutdown_grace_s {grace}"
    );
    // The failure policy names containers that exist.
    let mut names: Vec<&Value> = pod["containers"].as_array().unwrap().iter().collect();
    names.extend(pod["initContainers"].as_array().into_iter().flatten());
    for rule in spec["podFailurePolicy"]["rules"].as_array().unwrap() {
        if let Some(c) = rule["onExitCodes"]["containerName"].as_str() {
            assert!(names.iter().any(|n| n["name"] == c), "no container {c}");
        }
    }
    let ann = &spec["template"]["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(
        ann["prometheus.io/port"]
            .as_str()
            .unwrap()
            .parse::<u16>()
            .ok(),
        Some(port_of(metrics_addr)),
        "the scrape port is metrics_addr's"
    );

    let secret = manifest("secret.example.yaml");
    let secret_name = secret["metadata"]["name"].as_str().unwrap();
    for key in [
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
    ] {
        assert!(secret["stringData"][key].is_string(), "{key} in the Secret");
    }
    let cm_name = manifest("configmap.yaml")["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();

    let finalize = manifest("finalize-job.yaml");
    for (j, verb) in [(&job, "run"), (&finalize, "finalize")] {
        let c = container(j, "spool");
        // No command: the image's ENTRYPOINT ["spool"] runs.
        assert!(c["command"].is_null(), "{}", c["command"]);
        let args = c["args"].as_array().unwrap();
        assert_eq!(args[0], verb);
        let config = flag_value(args, "-c");
        let (dir, file) = config.rsplit_once('/').unwrap();
        let vol = volume_at(j, c, dir);
        assert_eq!(vol["configMap"]["name"], cm_name.as_str());
        // The whole ConfigMap is mounted, so its key is the file name.
        assert!(vol["configMap"]["items"].is_null());
        assert_eq!(file, "spool.toml");
        let env_from = c["envFrom"].as_array().unwrap();
        assert!(
            env_from
                .iter()
                .any(|e| e["secretRef"]["name"] == secret_name),
            "{} takes the S3 credentials from {secret_name}",
            j["metadata"]["name"]
        );
        // data_dir is the pod's own volume.
        assert!(volume_at(j, c, "/data")["emptyDir"].is_object());
    }
    assert_eq!(
        int(&finalize["spec"]["completions"], "finalize completions"),
        1
    );
}

/// The ConfigMap's `spool.toml` (and the Slurm example's) loads with spool's own config
/// loader (every key known, every value valid) with 4 partitions, the `s3://` output_dir
/// and `s3://` inputs, and the metrics address Prometheus scrapes.
#[test]
fn kubernetes_configmap_loads_with_spools_config_loader() {
    let (text, _) = configmap_toml();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spool.toml");
    std::fs::write(&path, text).unwrap();
    let cfg =
        spool::config::Config::load(&path, &Default::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.run.partitions, Some(4));
    assert_eq!(cfg.run.metrics_addr, "127.0.0.1:9100");
    let v = serde_json::to_value(&cfg).unwrap();
    assert_eq!(v["output_dir"], "s3://spool-shards/qwen3-drafter", "{v}");
    let paths: Vec<String> = cfg
        .datasets
        .iter()
        .map(|d| d.path.display().to_string())
        .collect();
    assert!(
        paths.iter().all(|p| p.starts_with("s3://spool-prompts/")),
        "{paths:?}"
    );
    let slurm = spool::config::Config::load(&slurm_dir().join("spool.toml"), &Default::default())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(slurm.run.partitions, Some(4));
    let slurm_addr: std::net::SocketAddr = slurm.run.metrics_addr.parse().unwrap();
    assert!(slurm_addr.ip().is_loopback(), "{slurm_addr}");
}

/// The Indexed Job run locally: four real `spool` processes with the Job's own arguments and
/// environment and `JOB_COMPLETION_INDEX` 0..3 as Kubernetes sets it, each with its own mock
/// server (as each pod has its own SGLang sidecar) and its own data_dir (as each pod has its
/// own volume), all committing to one shared output folder (the bucket). Each exits 0 and
/// logs which partition of 4 it runs; the rows the four servers were asked for are
/// disjoint and together are every input row; then the finalize Job's own arguments publish
/// them and `spool verify` finds the published output clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexed_job_pods_each_run_their_own_partition() {
    let job = manifest("job.yaml");
    let finalize = manifest("finalize-job.yaml");
    // A Job's arguments without `-c <path in the pod>`: Proc and `spool` pass the local config.
    let local_args = |j: &Value| -> Vec<String> {
        let args: Vec<String> = container(j, "spool")["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        let i = args.iter().position(|a| a == "-c").unwrap();
        // Each pod has its own IP; here the four share loopback, each on a free port.
        args[..i]
            .iter()
            .chain(&args[i + 2..])
            .map(|a| a.replace("$(POD_IP):9100", "127.0.0.1:0"))
            .collect()
    };
    let run_args = local_args(&job);
    let finalize_args = local_args(&finalize);
    assert_eq!(run_args, ["run", "--metrics-addr", "127.0.0.1:0"]);
    assert_eq!(finalize_args, ["finalize"]);
    // Plain values only: POD_IP (from the downward API) is replaced above.
    let env: Vec<(String, String)> = container(&job, "spool")["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| {
            Some((
                e["name"].as_str().unwrap().to_string(),
                e["value"].as_str()?.to_string(),
            ))
        })
        .collect();
    let partitions = int(&job["spec"]["completions"], "completions") as usize;

    let tmp = tempfile::tempdir().unwrap();
    let rows = 200;
    let prompts = tmp.path().join("alpha.jsonl");
    write_prompts(&prompts, "a", rows);
    let bucket = tmp.path().join("bucket");
    let mut mocks = Vec::new();
    let mut procs = Vec::new();
    let mut configs = Vec::new();
    for index in 0..partitions {
        let log = tmp.path().join(format!("mock-{index}.log"));
        let mock = Mock::start(MockConfig {
            log: Some(log.clone()),
            ..crate::support::fast_mock()
        })
        .await;
        let pod = tmp.path().join(format!("pod-{index}"));
        std::fs::create_dir_all(&pod).unwrap();
        let cfg = write_config(
            &pod,
            &mock.url,
            "sglang",
            true,
            &[Ds {
                name: "alpha",
                file: prompts.to_str().unwrap(),
                budget: None,
            }],
            "",
        );
        edit_config(
            &cfg,
            "[run]\n",
            &format!("[run]\npartitions = {partitions}\n"),
        );
        edit_config(
            &cfg,
            "output_dir = \"out\"",
            &format!("output_dir = \"{}\"", bucket.display()),
        );
        let mut env: Vec<(String, String)> = env.clone();
        env.push(("JOB_COMPLETION_INDEX".into(), index.to_string()));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let args: Vec<&str> = run_args.iter().map(String::as_str).collect();
        procs.push(Proc::spawn(&cfg, &args, &env));
        mocks.push((mock, log));
        configs.push(cfg);
    }
    let mut seen: Vec<BTreeSet<u64>> = Vec::new();
    for (index, p) in procs.iter_mut().enumerate() {
        let (status, _) = p.wait(Duration::from_secs(120)).await;
        let stderr = p.stderr();
        assert_eq!(status.code(), Some(0), "partition {index}:\n{stderr}");
        // The worker's start-up line names its partition as structured fields.
        let start = stderr
            .lines()
            .find(|l| l.contains("cluster worker starting"))
            .unwrap_or_else(|| panic!("no start-up line:\n{stderr}"));
        assert!(
            start.contains(&format!(" partition={index} "))
                && start.contains(&format!(" partitions={partitions} ")),
            "partition {index} of {partitions}: {start}"
        );
        let rows_seen: BTreeSet<u64> = mock_log(&mocks[index].1)
            .iter()
            .filter(|l| l.ds == "alpha")
            .map(|l| l.row)
            .collect();
        assert!(!rows_seen.is_empty(), "partition {index} generated nothing");
        seen.push(rows_seen);
    }
    let mut all = BTreeSet::new();
    for (i, s) in seen.iter().enumerate() {
        for row in s {
            assert!(all.insert(*row), "row {row} in partition {i} and another");
        }
    }
    assert_eq!(all.len(), rows, "every row in some partition");

    // The second Job: `spool finalize` with the same config publishes the manifest.
    let args: Vec<&str> = finalize_args.iter().map(String::as_str).collect();
    let out = crate::process::spool(&configs[0], &args, &[]);
    assert!(
        out.status.success(),
        "finalize: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(bucket.join("_manifest.json").is_file());
    crate::process::assert_verify_clean(&configs[0]);
}

// ---------------------------------------------------------------------------------------
// Slurm

/// The `#SBATCH` options of a script, in order.
fn sbatch_options(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("#SBATCH "))
        .map(|o| o.trim().to_string())
        .collect()
}

fn option<'a>(opts: &'a [String], name: &str) -> Option<&'a str> {
    opts.iter()
        .find_map(|o| o.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
}

/// The Slurm scripts parse (`bash -n`); the array has exactly `[run] partitions` tasks of the
/// Slurm config, is requeued on node failure, and gets SIGTERM early enough for spool's
/// graceful stop; the array runs `srun spool run`, the finalize script `spool finalize`.
#[test]
fn slurm_scripts_parse_and_match_the_config() {
    let dir = slurm_dir();
    for f in ["spool-array.sbatch", "spool-finalize.sbatch", "submit.sh"] {
        let out = Command::new("bash")
            .arg("-n")
            .arg(dir.join(f))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "bash -n {f}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let cfg: toml::Table =
        toml::from_str(&std::fs::read_to_string(dir.join("spool.toml")).unwrap()).unwrap();
    let partitions = cfg["run"]["partitions"].as_integer().unwrap();
    let grace = cfg["run"]["shutdown_grace_s"].as_integer().unwrap();

    let opts = sbatch_options(&dir.join("spool-array.sbatch"));
    let array = option(&opts, "--array").expect("#SBATCH --array");
    let (lo, hi) = array.split_once('-').unwrap();
    let (lo, hi): (i64, i64) = (lo.parse().unwrap(), hi.parse().unwrap());
    assert_eq!(lo, 0, "task ids from 0, so the index is the task id");
    assert_eq!(hi - lo + 1, partitions, "array size == partitions");
    assert!(opts.iter().any(|o| o == "--requeue"), "{opts:?}");
    let signal = option(&opts, "--signal").expect("#SBATCH --signal");
    let (sig, secs) = signal.split_once('@').unwrap();
    assert_eq!(
        sig, "B:TERM",
        "to the batch shell, whose trap passes it to spool"
    );
    assert!(
        secs.parse::<i64>().unwrap() > grace,
        "SIGTERM {secs} s before the limit must outlast shutdown_grace_s {grace}"
    );
    let script = std::fs::read_to_string(dir.join("spool-array.sbatch")).unwrap();
    assert!(script.contains("srun --ntasks=1 \"$SPOOL\" run -c \"$CONFIG\""));
    // The default data_dir, as bash expands it: node-local, one folder per partition.
    let out = Command::new("bash")
        .args([
            "-c",
            "eval \"$(sed -n '/^SPOOL=/,/^DATA_DIR=/p' \"$1\")\"; printf %s \"$DATA_DIR\"",
            "-",
        ])
        .arg(dir.join("spool-array.sbatch"))
        .env("USER", "alice")
        .env_remove("SPOOL_DATA_DIR")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "/scratch/alice/spool-{partition}",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fin = std::fs::read_to_string(dir.join("spool-finalize.sbatch")).unwrap();
    assert!(fin.contains("\"$SPOOL\" finalize -c \"$CONFIG\""));
    assert!(option(
        &sbatch_options(&dir.join("spool-finalize.sbatch")),
        "--array"
    )
    .is_none());
}

/// Writes an executable shell script.
fn script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// PATH with `bin` first.
fn path_with(bin: &Path) -> String {
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// `submit.sh` against a stand-in `sbatch` that records its arguments: the array is
/// submitted `--parsable`, and the finalize script is queued behind that job id (with the
/// cluster suffix of `--parsable` stripped) with `--dependency=afterok:<id>`.
#[test]
fn slurm_submit_queues_finalize_after_the_array() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let log = tmp.path().join("sbatch.log");
    script(
        &bin.join("sbatch"),
        &format!(
            "echo \"$*\" >> '{log}'\n\
             if [ \"$(wc -l < '{log}')\" -eq 1 ]; then echo '4242;clusterA'; else echo 4243; fi\n",
            log = log.display()
        ),
    );
    let out = Command::new("bash")
        .arg(slurm_dir().join("submit.sh"))
        .env("PATH", path_with(&bin))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let calls = std::fs::read_to_string(&log).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(
        calls[0],
        format!(
            "--parsable {}",
            slurm_dir().join("spool-array.sbatch").display()
        )
    );
    assert!(calls[1].starts_with("--parsable "), "{}", calls[1]);
    assert!(
        calls[1].contains(" --dependency=afterok:4242 "),
        "{}",
        calls[1]
    );
    assert!(calls[1].ends_with("/spool-finalize.sbatch"), "{}", calls[1]);
    assert!(stdout.contains("finalize job 4243"), "{stdout}");
}

/// An array task's batch shell, with stand-ins for `srun` (runs the command) and `scontrol`
/// (records its arguments), runs the real `spool run` against the mock as partition
/// `SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN` of `SLURM_ARRAY_TASK_COUNT`, in its own
/// `{partition}` data_dir; Slurm's early SIGTERM to the shell (`--signal=B:TERM@…`) reaches
/// spool through the trap, spool stops gracefully (130), and the task requeues itself as
/// `<array job>_<task>` to resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slurm_array_task_stops_spool_gracefully_and_requeues() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    // srun's options come first; the step's command is the rest.
    script(
        &bin.join("srun"),
        "while [ \"${1#-}\" != \"$1\" ]; do shift; done\nexec \"$@\"\n",
    );
    let requeue = tmp.path().join("scontrol.log");
    script(
        &bin.join("scontrol"),
        &format!("echo \"$*\" >> '{}'\n", requeue.display()),
    );
    // Slow enough that the run is still going when the signal comes.
    let mock = Mock::start(MockConfig {
        capacity_tps: 2000.0,
        per_request_tps: 50.0,
        mean_tokens: 40.0,
        time_scale: 1.0,
        ..MockConfig::for_tests()
    })
    .await;
    write_prompts(&tmp.path().join("alpha.jsonl"), "a", 2000);
    let cfg = write_config(
        tmp.path(),
        &mock.url,
        "sglang",
        true,
        &[Ds {
            name: "alpha",
            file: "alpha.jsonl",
            budget: None,
        }],
        "",
    );
    let mut child = Command::new("bash")
        .arg(slurm_dir().join("spool-array.sbatch"))
        .current_dir(tmp.path())
        .env("PATH", path_with(&bin))
        .env("SPOOL", spool_bin())
        .env("SPOOL_CONFIG", &cfg)
        .env("SPOOL_DATA_DIR", tmp.path().join("data-{partition}"))
        .env("SPOOL_NO_SERVER", "1")
        .env("SLURM_ARRAY_JOB_ID", "77")
        .env("SLURM_ARRAY_TASK_ID", "5")
        .env("SLURM_ARRAY_TASK_MIN", "4")
        .env("SLURM_ARRAY_TASK_COUNT", "4")
        .env("SLURM_JOB_ID", "78")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let collect = |r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            BufReader::new(r)
                .lines()
                .map_while(Result::ok)
                .collect::<Vec<_>>()
                .join("\n")
        })
    };
    let out = collect(Box::new(child.stdout.take().unwrap()));
    let err = collect(Box::new(child.stderr.take().unwrap()));
    // Requests arriving at the server: spool is up, its signal handler installed.
    tokio::time::timeout(
        Duration::from_secs(60),
        mock.state.wait_until(|s| s.requests >= 20),
    )
    .await
    .expect("spool sent requests within 60 s");
    assert_eq!(
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) },
        0,
        "SIGTERM to the batch shell"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the task did not end 60 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert_eq!(status.code(), Some(130), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("asking spool to stop gracefully"), "{out}");
    assert_eq!(
        std::fs::read_to_string(&requeue).unwrap(),
        "requeue 77_5\n",
        "{out}"
    );
    // Task 5 of an array starting at 4 is partition 1 of the array's 4 tasks, and its
    // data_dir is its own.
    let start = err
        .lines()
        .find(|l| l.contains("cluster worker starting"))
        .unwrap_or_else(|| panic!("no start-up line:\n{err}"));
    assert!(
        start.contains(" partition=1 ") && start.contains(" partitions=4 "),
        "{start}"
    );
    let data = tmp.path().join("data-1");
    assert!(data.is_dir(), "{{partition}} in --data-dir is the index");
    // Interrupted, not finished: some items are done, the rest left for the requeued task.
    let out = crate::process::spool(
        &cfg,
        &[
            "status",
            "--json",
            "-q",
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st: Value = serde_json::from_slice(&out.stdout).unwrap();
    let alpha = &st["datasets"][0];
    assert_eq!(alpha["name"], "alpha");
    assert!(alpha["done"].as_u64().unwrap() > 0, "{st}");
    assert!(alpha["done"].as_u64().unwrap() < 2000, "{st}");
}

// ---------------------------------------------------------------------------------------
// systemd

/// `key=value` lines of a unit's section.
fn unit_section(text: &str, section: &str) -> Vec<(String, String)> {
    let mut inside = false;
    let mut out = Vec::new();
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            inside = l == format!("[{section}]");
        } else if inside && !l.is_empty() && !l.starts_with('#') {
            let (k, v) = l.split_once('=').unwrap();
            out.push((k.to_string(), v.to_string()));
        }
    }
    out
}

/// `deploy/systemd/spool.service`: `systemd-analyze verify` passes without a warning (with
/// ExecStart pointed at the binary under test); the unit restarts on failure only, stops
/// with SIGTERM and waits longer than spool's default shutdown grace (30 s), counts 130 (a
/// clean interrupted stop) as success, logs to the journal and keeps data_dir in its
/// StateDirectory.
#[test]
fn systemd_unit_verifies() {
    let text = std::fs::read_to_string(root().join("deploy/systemd/spool.service")).unwrap();
    let service = unit_section(&text, "Service");
    let get = |k: &str| {
        service
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no {k}= in [Service]"))
    };
    assert_eq!(get("Restart"), "on-failure");
    assert_eq!(get("KillSignal"), "SIGTERM");
    assert!(get("TimeoutStopSec").parse::<u32>().unwrap() > 30);
    assert_eq!(get("SuccessExitStatus"), "130");
    assert_eq!(get("StandardError"), "journal");
    assert_eq!(get("StateDirectory"), "spool");
    let exec = get("ExecStart");
    assert!(
        exec.starts_with("/usr/local/bin/spool run -c /etc/spool/spool.toml"),
        "{exec}"
    );
    assert!(
        exec.ends_with("--data-dir /var/lib/spool"),
        "the StateDirectory"
    );

    let analyze = tool(
        "systemd-analyze",
        "apt-get install systemd (verify needs no running systemd)",
    );
    let tmp = tempfile::tempdir().unwrap();
    let unit = tmp.path().join("spool.service");
    std::fs::write(
        &unit,
        text.replace("/usr/local/bin/spool", spool_bin().to_str().unwrap()),
    )
    .unwrap();
    let verify = |unit: &Path| {
        let out = Command::new(&analyze)
            .arg("verify")
            .arg(unit)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, stderr) = verify(&unit);
    // Unknown keys and bad values are only warnings (exit 0): any output is a finding.
    assert!(
        ok && stderr.trim().is_empty(),
        "systemd-analyze verify:\n{stderr}"
    );

    // A misspelt key is caught the same way.
    std::fs::write(
        &unit,
        std::fs::read_to_string(&unit)
            .unwrap()
            .replacen("KillSignal=", "KilSignal=", 1),
    )
    .unwrap();
    let (_, stderr) = verify(&unit);
    assert!(stderr.contains("Unknown key 'KilSignal'"), "{stderr}");
}

// ---------------------------------------------------------------------------------------
// Docker

/// The Dockerfile builds with the pinned toolchain from the lock file (`--locked`) at least
/// as new as Cargo.toml's rust-version, runs as a non-root numeric user with CA roots, and
/// its ENTRYPOINT is `spool` (the Jobs give only arguments); `.dockerignore` lets through
/// every path the Dockerfile copies.
#[test]
fn dockerfile_builds_the_release_binary_for_a_non_root_user() {
    let text = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let froms: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("FROM "))
        .collect();
    assert_eq!(
        froms,
        ["rust:1.95-slim-bookworm AS builder", "debian:bookworm-slim"]
    );
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let msrv = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .unwrap();
    let minor = |v: &str| v.split('.').nth(1).unwrap().parse::<u32>().unwrap();
    assert!(minor("1.95") >= minor(msrv), "rust-version {msrv}");
    assert!(text.contains("cargo build --release --locked"));
    assert!(text.contains("ca-certificates"));
    let user = text
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("USER");
    let uid: u32 = user
        .split(':')
        .next()
        .unwrap()
        .parse()
        .expect("numeric USER");
    assert_ne!(uid, 0);
    assert!(text.contains("ENTRYPOINT [\"spool\"]"));

    // Every COPY source from the context is let through by .dockerignore (`*` then `!path`).
    let ignore = std::fs::read_to_string(root().join(".dockerignore")).unwrap();
    let allowed: Vec<&str> = ignore
        .lines()
        .filter_map(|l| l.strip_prefix('!'))
        .map(|l| l.trim_end_matches('/'))
        .collect();
    assert!(ignore.lines().any(|l| l == "*"));
    let mut copied = 0;
    for line in text
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from="))
    {
        let parts: Vec<&str> = line.split_whitespace().collect();
        for src in &parts[1..parts.len() - 1] {
            assert!(allowed.contains(src), "{src} is copied but ignored");
            assert!(root().join(src).exists(), "{src}");
            copied += 1;
        }
    }
    assert!(copied >= 3, "Cargo.toml, Cargo.lock and src at least");
}

// ---------------------------------------------------------------------------------------
// Grafana

/// The dashboard's "All" partitions (`allValue` `.*`) select series that have no
/// `partition` label as well as those that do, so the same dashboard reads a single process
/// and a cluster run: checked by promtool's PromQL unit test on both kinds of series.
#[test]
fn dashboard_all_partitions_matches_series_with_and_without_the_label() {
    let promtool = tool(
        "promtool",
        "apt-get install -y --no-install-recommends prometheus, as .ci/run does",
    );
    let d: Value = serde_json::from_slice(
        &std::fs::read(root().join("grafana/dashboards/spool.json")).unwrap(),
    )
    .unwrap();
    let var = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "partition")
        .expect("a partition variable");
    let all = var["allValue"].as_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let test = tmp.path().join("partition_test.yml");
    std::fs::write(
        &test,
        format!(
            r#"rule_files: []
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'spool_items{{dataset="a",state="done"}}'
        values: '1 2 3'
      - series: 'spool_items{{dataset="a",state="done",partition="1"}}'
        values: '10 20 30'
      - series: 'spool_items{{dataset="a",state="done",partition="2"}}'
        values: '100 200 300'
    promql_expr_test:
      - expr: 'sum by (dataset) (spool_items{{partition=~"{all}"}})'
        eval_time: 2m
        exp_samples:
          - labels: '{{dataset="a"}}'
            value: 333
      - expr: 'sum by (dataset) (spool_items{{partition=~"1|2"}})'
        eval_time: 2m
        exp_samples:
          - labels: '{{dataset="a"}}'
            value: 330
"#
        ),
    )
    .unwrap();
    let out = Command::new(promtool)
        .args(["test", "rules"])
        .arg(&test)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("SUCCESS"), "{text}");
}
