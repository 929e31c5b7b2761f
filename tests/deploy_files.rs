//! The deployment files: `Dockerfile`, `deploy/docker-compose.yml`, `deploy/prometheus.yml`,
//! Grafana provisioning and `deploy/kubernetes/*.yaml`. No container engine or cluster runs
//! here, so this checks what can be checked without one: every YAML document parses, the
//! Kubernetes objects and compose services have the shape the README promises (probes, config
//! from a ConfigMap, admin token from a Secret created out of band, compactor as a native
//! sidecar, Services selecting real pods, the commented Prometheus Operator monitors), no
//! placeholder Secret is shipped, and every compactor configuration the files carry — ConfigMap
//! `compactor.toml` entries and `.toml` files under `deploy/` — passes the real
//! `compactor check-config`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use yaml_rust2::{Yaml, YamlLoader};

const CONFIG_PATH: &str = "/etc/compactor/compactor.toml";
const CONFIG_DIR: &str = "/etc/compactor";
/// The compose configuration (and the image's default), relative to `deploy/`: a file in the
/// directory compose mounts at [`CONFIG_DIR`].
const COMPOSE_CONFIG: &str = "compactor/compactor.toml";
const ADMIN_PORT: i64 = 9787;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn deploy_dir() -> PathBuf {
    root().join("deploy")
}

/// Files under `dir` (recursively) whose name ends with one of `exts`, sorted.
fn files_under(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    fn walk(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                walk(&path, exts, out);
            } else if path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| exts.contains(&e))
            {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, exts, &mut out);
    out.sort();
    out
}

fn yaml_files() -> Vec<PathBuf> {
    files_under(&deploy_dir(), &["yml", "yaml"])
}

/// Every document of a YAML file (multi-document files included).
fn load(path: &Path) -> Vec<Yaml> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn load_one(relative: &str) -> Yaml {
    let docs = load(&deploy_dir().join(relative));
    assert_eq!(docs.len(), 1, "{relative}: expected one document");
    docs.into_iter().next().expect("one document")
}

fn str_of<'a>(y: &'a Yaml, what: &str) -> &'a str {
    y.as_str()
        .unwrap_or_else(|| panic!("{what}: expected a string, got {y:?}"))
}

fn list(y: &Yaml) -> &[Yaml] {
    y.as_vec().map(Vec::as_slice).unwrap_or(&[])
}

/// The Kubernetes manifests, each document with the file it came from.
fn k8s_docs() -> Vec<(String, Yaml)> {
    files_under(&deploy_dir().join("kubernetes"), &["yml", "yaml"])
        .into_iter()
        .flat_map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            load(&path).into_iter().map(move |doc| (name.clone(), doc))
        })
        .collect()
}

fn kind_is<'a>(docs: &'a [(String, Yaml)], file: &'a str, kind: &'a str) -> Vec<&'a Yaml> {
    docs.iter()
        .filter(|(f, d)| f == file && d["kind"].as_str() == Some(kind))
        .map(|(_, d)| d)
        .collect()
}

fn find<'a>(docs: &'a [(String, Yaml)], file: &str, kind: &str, name: &str) -> &'a Yaml {
    docs.iter()
        .find(|(f, d)| {
            f == file
                && d["kind"].as_str() == Some(kind)
                && d["metadata"]["name"].as_str() == Some(name)
        })
        .map(|(_, d)| d)
        .unwrap_or_else(|| panic!("{file}: no {kind} named {name}"))
}

/// Runs `compactor check-config --config <path>` with no `COMPACTOR_*` variable inherited, and
/// returns the effective configuration it prints.
fn check_config(path: &Path, what: &str) -> toml::Value {
    check_config_with(path, what, &[])
}

/// [`check_config`] with these `COMPACTOR_*` variables set (as a compose file sets them).
fn check_config_with(path: &Path, what: &str, env: &[(&str, &str)]) -> toml::Value {
    let mut command = Command::new(env!("CARGO_BIN_EXE_compactor"));
    command.arg("check-config").arg("--config").arg(path);
    for (key, _) in std::env::vars() {
        if key.starts_with("COMPACTOR_") {
            command.env_remove(key);
        }
    }
    command.envs(env.iter().copied());
    let out = command.output().expect("run compactor check-config");
    assert!(
        out.status.success(),
        "{what}: compactor check-config failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    toml::from_str(&String::from_utf8_lossy(&out.stdout))
        .unwrap_or_else(|e| panic!("{what}: check-config output is not TOML: {e}"))
}

fn port_of(addr: &str) -> i64 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {addr}"))
}

#[test]
fn every_yaml_file_parses() {
    let files = yaml_files();
    let names: BTreeSet<String> = files
        .iter()
        .map(|p| {
            p.strip_prefix(deploy_dir())
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/")
        })
        .collect();
    for expected in [
        "docker-compose.yml",
        "prometheus.yml",
        "grafana/provisioning/datasources/prometheus.yml",
        "grafana/provisioning/dashboards/compactor.yml",
        "kubernetes/sidecar.yaml",
        "kubernetes/gateway.yaml",
    ] {
        assert!(
            names.contains(expected),
            "deploy/{expected} missing: {names:?}"
        );
    }
    for path in &files {
        let docs = load(path);
        assert!(!docs.is_empty(), "{}: no YAML document", path.display());
        for (i, doc) in docs.iter().enumerate() {
            assert!(
                doc.as_hash().is_some(),
                "{} document {i}: not a mapping: {doc:?}",
                path.display()
            );
        }
    }
}

#[test]
fn kubernetes_objects_are_well_formed() {
    let docs = k8s_docs();
    assert!(!docs.is_empty());
    for (file, doc) in &docs {
        for key in ["apiVersion", "kind"] {
            assert!(
                doc[key].as_str().is_some_and(|s| !s.is_empty()),
                "{file}: {key} missing in {doc:?}"
            );
        }
        let name = str_of(&doc["metadata"]["name"], &format!("{file}: metadata.name"));
        assert!(!name.is_empty(), "{file}: empty metadata.name");
    }
    // Every Service selects the pods of some Deployment in the same file.
    for (file, svc) in docs
        .iter()
        .filter(|(_, d)| d["kind"].as_str() == Some("Service"))
    {
        let selector = svc["spec"]["selector"].as_hash().expect("Service selector");
        let matched = kind_is(&docs, file, "Deployment").into_iter().any(|dep| {
            let labels = &dep["spec"]["template"]["metadata"]["labels"];
            selector
                .iter()
                .all(|(k, v)| &labels[str_of(k, "selector key")] == v)
        });
        assert!(
            matched,
            "{file}: Service {:?} selects no Deployment's pods",
            svc["metadata"]["name"]
        );
    }
}

fn is_compactor(c: &Yaml) -> bool {
    c["image"]
        .as_str()
        .is_some_and(|i| i.starts_with("compactor:"))
}

/// The compactor containers of a file's Deployments, in `initContainers` (a native sidecar) or
/// `containers`, with the pod spec holding them.
fn compactor_pods<'a>(docs: &'a [(String, Yaml)], file: &'a str) -> Vec<(&'a Yaml, &'a Yaml)> {
    kind_is(docs, file, "Deployment")
        .into_iter()
        .flat_map(|dep| {
            let pod = &dep["spec"]["template"]["spec"];
            list(&pod["initContainers"])
                .iter()
                .chain(list(&pod["containers"]))
                .filter(|c| is_compactor(c))
                .map(move |c| (pod, c))
        })
        .collect()
}

/// The `secretKeyRef` (name, key) compactor reads `COMPACTOR_ADMIN__TOKEN` from.
fn admin_token_ref<'a>(file: &str, c: &'a Yaml) -> (&'a str, &'a str) {
    let token = list(&c["env"])
        .iter()
        .find(|e| e["name"].as_str() == Some("COMPACTOR_ADMIN__TOKEN"))
        .unwrap_or_else(|| panic!("{file}: no COMPACTOR_ADMIN__TOKEN"));
    let secret_ref = &token["valueFrom"]["secretKeyRef"];
    let name = str_of(&secret_ref["name"], "secretKeyRef.name");
    let key = str_of(&secret_ref["key"], "secretKeyRef.key");
    assert!(
        !name.is_empty() && !key.is_empty(),
        "{file}: {secret_ref:?}"
    );
    (name, key)
}

fn k8s_text(file: &str) -> String {
    let path = deploy_dir().join("kubernetes").join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// An HTTP GET probe on `path` at the admin port (by name or number).
fn assert_admin_probe(file: &str, probe: &str, c: &Yaml, path: &str) {
    let get = &c[probe]["httpGet"];
    assert_eq!(get["path"].as_str(), Some(path), "{file}: {probe} path");
    assert!(
        get["port"].as_str() == Some("admin") || get["port"].as_i64() == Some(ADMIN_PORT),
        "{file}: {probe} not on the admin port: {:?}",
        get["port"]
    );
}

/// Probes on /livez and /readyz at the admin port, config from a ConfigMap holding
/// `compactor.toml` mounted at /etc/compactor, the admin token from a Secret: one the file
/// tells the operator to create (`kubectl create secret generic <name> --from-literal=<key>=`),
/// or, if the file carries the Secret, one with that key.
fn assert_compactor_container(docs: &[(String, Yaml)], file: &str, pod: &Yaml, c: &Yaml) {
    let ports = list(&c["ports"]);
    let admin = ports
        .iter()
        .find(|p| p["name"].as_str() == Some("admin"))
        .unwrap_or_else(|| panic!("{file}: compactor has no port named admin"));
    assert_eq!(
        admin["containerPort"].as_i64(),
        Some(ADMIN_PORT),
        "{file}: admin port"
    );
    for (probe, path) in [("livenessProbe", "/livez"), ("readinessProbe", "/readyz")] {
        assert_admin_probe(file, probe, c, path);
    }
    let args: Vec<&str> = list(&c["args"]).iter().filter_map(Yaml::as_str).collect();
    assert_eq!(
        args,
        ["serve", "--config", CONFIG_PATH],
        "{file}: compactor args"
    );

    let (secret_name, key) = admin_token_ref(file, c);
    let shipped = docs.iter().find(|(f, d)| {
        f == file
            && d["kind"].as_str() == Some("Secret")
            && d["metadata"]["name"].as_str() == Some(secret_name)
    });
    match shipped {
        Some((_, secret)) => assert!(
            !secret["stringData"][key].is_badvalue() || !secret["data"][key].is_badvalue(),
            "{file}: Secret {secret_name} has no key {key}"
        ),
        None => {
            let create =
                format!("kubectl create secret generic {secret_name} --from-literal={key}=");
            assert!(
                k8s_text(file).contains(&create),
                "{file}: Secret {secret_name} is not in the file, and no comment says `{create}...`"
            );
        }
    }

    let mount = list(&c["volumeMounts"])
        .iter()
        .find(|m| m["mountPath"].as_str() == Some(CONFIG_DIR))
        .unwrap_or_else(|| panic!("{file}: nothing mounted at /etc/compactor"));
    let volume = list(&pod["volumes"])
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("{file}: no volume {:?}", mount["name"]));
    let cm_name = str_of(&volume["configMap"]["name"], "configMap volume name");
    let cm = find(docs, file, "ConfigMap", cm_name);
    assert!(
        cm["data"]["compactor.toml"].as_str().is_some(),
        "{file}: ConfigMap {cm_name} has no compactor.toml"
    );

    let security = &c["securityContext"];
    let non_root = security["runAsNonRoot"].as_bool() == Some(true)
        || pod["securityContext"]["runAsNonRoot"].as_bool() == Some(true);
    assert!(non_root, "{file}: compactor not runAsNonRoot");
}

#[test]
fn sidecar_runs_compactor_beside_an_agent() {
    let docs = k8s_docs();
    let file = "sidecar.yaml";
    let pods = compactor_pods(&docs, file);
    assert_eq!(pods.len(), 1, "{file}: one compactor container");
    let (pod, c) = pods[0];
    assert_compactor_container(&docs, file, pod, c);

    // A native sidecar: an init container that keeps running (restartPolicy: Always), whose
    // startup probe on /readyz holds the agent back until compactor is ready.
    assert!(
        list(&pod["initContainers"]).iter().any(|i| i == c),
        "{file}: compactor is not an initContainer"
    );
    assert_eq!(
        c["restartPolicy"].as_str(),
        Some("Always"),
        "{file}: compactor is an init container without restartPolicy: Always (it would have to exit before the agent starts)"
    );
    assert_admin_probe(file, "startupProbe", c, "/readyz");
    assert!(
        !list(&pod["containers"]).iter().any(is_compactor),
        "{file}: compactor also in containers"
    );

    let agents = list(&pod["containers"]);
    assert_eq!(
        agents.len(),
        1,
        "{file}: one agent container beside compactor"
    );
    let agent = &agents[0];
    // The agent talks to compactor over the pod's loopback.
    let env = list(&agent["env"]);
    assert!(
        env.iter().any(|e| e["value"]
            .as_str()
            .is_some_and(|v| v.starts_with("http://127.0.0.1:8787"))),
        "{file}: the agent is not pointed at compactor on localhost"
    );
    // The agent runs the model's tool calls: unprivileged too.
    let security = &agent["securityContext"];
    assert!(
        security["runAsNonRoot"].as_bool() == Some(true)
            || pod["securityContext"]["runAsNonRoot"].as_bool() == Some(true),
        "{file}: the agent is not runAsNonRoot"
    );
    assert_eq!(
        security["allowPrivilegeEscalation"].as_bool(),
        Some(false),
        "{file}: the agent may escalate privileges"
    );
    let dropped: Vec<&str> = list(&security["capabilities"]["drop"])
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert_eq!(dropped, ["ALL"], "{file}: the agent's capabilities");
    // A read-only root filesystem leaves the agent a writable emptyDir for its workspace.
    if security["readOnlyRootFilesystem"].as_bool() == Some(true) {
        let writable: Vec<&str> = list(&agent["volumeMounts"])
            .iter()
            .filter(|m| m["readOnly"].as_bool() != Some(true))
            .filter(|m| {
                list(&pod["volumes"])
                    .iter()
                    .any(|v| v["name"] == m["name"] && !v["emptyDir"].is_badvalue())
            })
            .filter_map(|m| m["mountPath"].as_str())
            .collect();
        assert!(
            writable.iter().any(|p| p.contains("workspace")),
            "{file}: read-only agent without a writable workspace emptyDir: {writable:?}"
        );
    }
}

/// The commented-out YAML documents of a Kubernetes file: comment blocks from a line
/// `# apiVersion: ...` on, with the leading `# ` taken off, parsed.
fn commented_docs(file: &str) -> Vec<Yaml> {
    let text = k8s_text(file);
    let mut docs = Vec::new();
    let mut block: Option<String> = None;
    for line in text.lines().chain([""]) {
        let uncommented = line
            .strip_prefix("# ")
            .or_else(|| (line == "#").then_some(""));
        match (&mut block, uncommented) {
            (None, Some(rest)) if rest.starts_with("apiVersion:") => {
                block = Some(format!("{rest}\n"));
            }
            (Some(b), Some(rest)) if rest.trim() != "---" => {
                b.push_str(rest);
                b.push('\n');
            }
            (Some(_), _) => {
                let b = block.take().expect("block");
                let parsed = YamlLoader::load_from_str(&b)
                    .unwrap_or_else(|e| panic!("{file}: commented YAML: {e}\n{b}"));
                docs.extend(parsed);
            }
            (None, _) => {}
        }
    }
    docs
}

/// The commented Prometheus Operator example of each file scrapes compactor's admin port and
/// sends the admin token from the Secret compactor reads it from.
#[test]
fn prometheus_operator_examples_send_the_admin_token() {
    let docs = k8s_docs();
    for (file, kind, endpoints) in [
        ("sidecar.yaml", "PodMonitor", "podMetricsEndpoints"),
        ("gateway.yaml", "ServiceMonitor", "endpoints"),
    ] {
        let monitors: Vec<Yaml> = commented_docs(file)
            .into_iter()
            .filter(|d| d["kind"].as_str() == Some(kind))
            .collect();
        assert_eq!(monitors.len(), 1, "{file}: one commented {kind}");
        let monitor = &monitors[0];
        assert_eq!(
            monitor["apiVersion"].as_str(),
            Some("monitoring.coreos.com/v1"),
            "{file}: {kind}"
        );
        let (pod, c) = compactor_pods(&docs, file)[0];
        let (secret, key) = admin_token_ref(file, c);
        let endpoint = list(&monitor["spec"][endpoints])
            .iter()
            .find(|e| e["port"].as_str() == Some("admin"))
            .unwrap_or_else(|| panic!("{file}: {kind} has no endpoint on port admin"));
        assert_eq!(
            endpoint["path"].as_str(),
            Some("/metrics"),
            "{file}: {kind}"
        );
        let auth = &endpoint["authorization"];
        assert_eq!(auth["type"].as_str(), Some("Bearer"), "{file}: {kind}");
        assert_eq!(
            auth["credentials"]["name"].as_str(),
            Some(secret),
            "{file}: {kind} credentials"
        );
        assert_eq!(
            auth["credentials"]["key"].as_str(),
            Some(key),
            "{file}: {kind} credentials"
        );

        // It selects compactor's pods (PodMonitor) or a Service with the admin port that
        // selects them (ServiceMonitor).
        let wanted = monitor["spec"]["selector"]["matchLabels"]
            .as_hash()
            .unwrap_or_else(|| panic!("{file}: {kind} selector.matchLabels"));
        let selects = |labels: &Yaml| {
            wanted
                .iter()
                .all(|(k, v)| &labels[str_of(k, "matchLabels key")] == v)
        };
        let pod_labels = kind_is(&docs, file, "Deployment")
            .into_iter()
            .find(|d| &d["spec"]["template"]["spec"] == pod)
            .map(|d| &d["spec"]["template"]["metadata"]["labels"])
            .expect("compactor's Deployment");
        if kind == "PodMonitor" {
            assert!(
                selects(pod_labels),
                "{file}: {kind} misses compactor's pods"
            );
        } else {
            let admin_service = kind_is(&docs, file, "Service").into_iter().any(|svc| {
                selects(&svc["metadata"]["labels"])
                    && list(&svc["spec"]["ports"])
                        .iter()
                        .any(|p| p["name"].as_str() == Some("admin"))
                    && svc["spec"]["selector"]
                        .as_hash()
                        .expect("Service selector")
                        .iter()
                        .all(|(k, v)| &pod_labels[str_of(k, "selector key")] == v)
            });
            assert!(
                admin_service,
                "{file}: {kind} selects no Service with compactor's admin port"
            );
        }
    }
}

/// A Secret committed under deploy/ is a placeholder everyone knows (`token: change-me` gets
/// deployed as is): the files name their Secrets and say how to create them instead.
#[test]
fn no_placeholder_secret_is_shipped() {
    for path in yaml_files() {
        let what = path.strip_prefix(root()).unwrap().display().to_string();
        for doc in load(&path) {
            if doc["kind"].as_str() != Some("Secret") {
                continue;
            }
            let values: Vec<String> = ["stringData", "data"]
                .iter()
                .flat_map(|field| doc[*field].as_hash().into_iter().flatten())
                .map(|(k, v)| format!("{k:?}: {v:?}"))
                .collect();
            assert!(
                values.is_empty(),
                "{what}: Secret {:?} ships values {values:?}; create it out of band",
                doc["metadata"]["name"]
            );
        }
    }
    for path in files_under(&deploy_dir(), &["yml", "yaml", "toml"]) {
        let text = std::fs::read_to_string(&path).expect("deploy file");
        assert!(
            !text.contains("change-me"),
            "{}: a change-me placeholder",
            path.display()
        );
    }
}

#[test]
fn gateway_replicas_share_sessions_through_redis() {
    let docs = k8s_docs();
    let file = "gateway.yaml";
    let pods = compactor_pods(&docs, file);
    assert_eq!(pods.len(), 1, "{file}: one compactor Deployment");
    let (pod, c) = pods[0];
    assert_compactor_container(&docs, file, pod, c);

    let deployment = find(&docs, file, "Deployment", "compactor-gateway");
    let replicas = deployment["spec"]["replicas"].as_i64().expect("replicas");
    assert!(replicas >= 2, "{file}: {replicas} replica(s)");

    // The replicas share sessions through Redis, so the Service spreads requests freely.
    let proxy = find(&docs, file, "Service", "compactor-gateway");
    assert!(
        proxy["spec"]["sessionAffinity"].is_badvalue(),
        "{file}: affinity is not needed with the shared store"
    );
    let cm = find(&docs, file, "ConfigMap", "compactor-gateway");
    let toml_text = str_of(&cm["data"]["compactor.toml"], "compactor.toml");
    let config: toml::Value = toml::from_str(toml_text).expect("ConfigMap TOML");
    assert_eq!(config["store"]["backend"].as_str(), Some("redis"), "{file}");
    let url = config["store"]["redis_url"].as_str().expect("redis_url");
    let (host, port) = url
        .strip_prefix("redis://")
        .and_then(|rest| rest.split_once(':'))
        .expect("redis://host:port");
    let service = find(&docs, file, "Service", host);
    assert!(
        list(&service["spec"]["ports"])
            .iter()
            .any(|p| p["port"].as_i64() == port.parse().ok()),
        "{file}: redis_url names Service {host} port {port}"
    );

    let redis = kind_is(&docs, file, "Deployment")
        .into_iter()
        .flat_map(|d| list(&d["spec"]["template"]["spec"]["containers"]))
        .any(|c| c["image"].as_str().is_some_and(|i| i.starts_with("redis:")));
    assert!(redis, "{file}: no Redis Deployment");
    assert!(
        kind_is(&docs, file, "Service")
            .iter()
            .any(|s| list(&s["spec"]["ports"])
                .iter()
                .any(|p| p["port"].as_i64() == Some(6379))),
        "{file}: no Redis Service"
    );
}

#[test]
fn compose_has_the_four_services_and_mounts_existing_files() {
    let compose = load_one("docker-compose.yml");
    let services = compose["services"].as_hash().expect("services");
    let names: BTreeSet<&str> = services.keys().filter_map(Yaml::as_str).collect();
    for s in ["compactor", "redis", "prometheus", "grafana"] {
        assert!(names.contains(s), "docker-compose.yml: no service {s}");
    }
    // Every bind mount's source exists (relative to deploy/, as compose resolves it).
    let mut mounts = Vec::new();
    for (name, service) in services {
        for v in list(&service["volumes"]) {
            let spec = str_of(v, "volume");
            let (source, target) = spec.split_once(':').expect("source:target");
            let target = target.split(':').next().unwrap();
            if source.starts_with('.') {
                let path = deploy_dir().join(source);
                assert!(path.exists(), "{name:?}: mounts missing {}", path.display());
                mounts.push((
                    str_of(name, "service").to_owned(),
                    source.to_owned(),
                    target.to_owned(),
                ));
            }
        }
    }
    // A directory, not the single file: a single-file bind mount keeps the inode it was given,
    // so an editor replacing the file would never reach the container (nor hot reload).
    let config_dir = mounts
        .iter()
        .find(|(s, _, dst)| s == "compactor" && dst == CONFIG_DIR)
        .map(|(_, src, _)| deploy_dir().join(src))
        .unwrap_or_else(|| {
            panic!("compactor does not mount a directory at {CONFIG_DIR}: {mounts:?}")
        });
    assert!(
        config_dir.is_dir() && config_dir.join("compactor.toml").is_file(),
        "{} is not a directory holding compactor.toml",
        config_dir.display()
    );
    assert_eq!(
        config_dir.join("compactor.toml").canonicalize().unwrap(),
        deploy_dir().join(COMPOSE_CONFIG).canonicalize().unwrap()
    );
    assert!(
        !mounts
            .iter()
            .any(|(s, _, dst)| s == "compactor" && dst.starts_with(&format!("{CONFIG_DIR}/"))),
        "compactor bind-mounts a single file under {CONFIG_DIR}: {mounts:?}"
    );
    let args: Vec<&str> = list(&services[&Yaml::String("compactor".into())]["command"])
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert_eq!(
        args,
        ["serve", "--config", CONFIG_PATH],
        "compactor command"
    );
    assert!(
        mounts
            .iter()
            .any(|(s, src, _)| s == "grafana" && src == "../config/grafana/compactor.json"),
        "grafana does not mount config/grafana/compactor.json: {mounts:?}"
    );
    let c = &compose["services"]["compactor"];
    // Sessions in the compose Redis, set through the environment over the mounted file.
    let env: Vec<(&str, &str)> = c["environment"]
        .as_hash()
        .expect("compactor environment")
        .iter()
        .filter_map(|(k, v)| Some((k.as_str()?, v.as_str()?)))
        .filter(|(k, _)| k.starts_with("COMPACTOR_"))
        .collect();
    let url = env
        .iter()
        .find(|(k, _)| *k == "COMPACTOR_STORE__REDIS_URL")
        .map(|(_, v)| *v)
        .expect("COMPACTOR_STORE__REDIS_URL");
    assert!(
        url.starts_with("redis://redis:"),
        "{url}: the compose redis service"
    );
    let config = check_config_with(
        &deploy_dir().join(COMPOSE_CONFIG),
        "deploy/compactor/compactor.toml with the compose environment",
        &env,
    );
    assert_eq!(config["store"]["backend"].as_str(), Some("redis"));
    let ports: Vec<&str> = list(&c["ports"]).iter().filter_map(Yaml::as_str).collect();
    assert!(
        ports.iter().any(|p| p.ends_with(":8787")) && ports.iter().any(|p| p.ends_with(":9787")),
        "{ports:?}"
    );

    // Anthropic clients (Claude Code) go through the /anthropic route, and the file says how
    // to point them at it on the published proxy port.
    let routes = config["routes"].as_array().expect("routes");
    assert!(
        routes.iter().any(|r| {
            r["prefix"].as_str() == Some("/anthropic")
                && r["base_url"].as_str() == Some("https://api.anthropic.com")
        }),
        "no /anthropic route: {routes:?}"
    );
    assert!(
        ports.contains(&"127.0.0.1:8787:8787"),
        "proxy not published on 127.0.0.1:8787: {ports:?}"
    );
    let text = std::fs::read_to_string(deploy_dir().join(COMPOSE_CONFIG)).expect("config");
    assert!(
        text.contains("ANTHROPIC_BASE_URL=http://127.0.0.1:8787/anthropic"),
        "deploy/{COMPOSE_CONFIG} does not say how to point Claude Code at the route"
    );
}

#[test]
fn prometheus_scrapes_the_admin_metrics() {
    let prom = load_one("prometheus.yml");
    let job = list(&prom["scrape_configs"])
        .iter()
        .find(|j| j["job_name"].as_str() == Some("compactor"))
        .expect("a compactor scrape job");
    assert_eq!(job["metrics_path"].as_str(), Some("/metrics"));
    let targets: Vec<&str> = list(&job["static_configs"])
        .iter()
        .flat_map(|s| list(&s["targets"]))
        .filter_map(Yaml::as_str)
        .collect();
    assert_eq!(targets, [format!("compactor:{ADMIN_PORT}")]);
    // And that is where the compose configuration puts the admin listener.
    let config = check_config(
        &deploy_dir().join(COMPOSE_CONFIG),
        "deploy/compactor/compactor.toml",
    );
    let admin = config["server"]["admin_listen"]
        .as_str()
        .expect("admin_listen");
    assert_eq!(port_of(admin), ADMIN_PORT);
}

/// The compose entrypoint rewrites the dashboard's `${DS_PROMETHEUS}` input to the provisioned
/// datasource's uid (file provisioning does not resolve `__inputs`), into the directory the
/// dashboard provider reads.
#[test]
fn grafana_provisioning_resolves_the_dashboard_datasource() {
    let ds = load_one("grafana/provisioning/datasources/prometheus.yml");
    let ds = &list(&ds["datasources"])[0];
    assert_eq!(ds["type"].as_str(), Some("prometheus"));
    assert_eq!(ds["url"].as_str(), Some("http://prometheus:9090"));
    let uid = str_of(&ds["uid"], "datasource uid");

    let provider = load_one("grafana/provisioning/dashboards/compactor.yml");
    let dir = str_of(
        &list(&provider["providers"])[0]["options"]["path"],
        "provider path",
    );

    let compose = load_one("docker-compose.yml");
    let entrypoint: Vec<&str> = list(&compose["services"]["grafana"]["entrypoint"])
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    let script = entrypoint.last().expect("entrypoint script");
    // "$$" is compose's escape for "$".
    let sed = format!("sed 's/\\$${{DS_PROMETHEUS}}/{uid}/g'");
    assert!(script.contains(&sed), "entrypoint lacks {sed}: {script}");
    assert!(
        script.contains(&format!("> {dir}/compactor.json")),
        "{script}"
    );
    assert!(script.trim_end().ends_with("exec /run.sh"), "{script}");

    let dashboard =
        std::fs::read_to_string(root().join("config/grafana/compactor.json")).expect("dashboard");
    assert!(
        dashboard.contains("${DS_PROMETHEUS}"),
        "the dashboard no longer uses the input"
    );
    let resolved = dashboard.replace("${DS_PROMETHEUS}", uid);
    assert!(
        !resolved.contains("${DS_"),
        "another datasource input is left unresolved"
    );
    let json: serde_json::Value = serde_json::from_str(&resolved).expect("still JSON");
    // Every Prometheus datasource reference (panels, queries, variables) now names it.
    fn prometheus_uids<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
        match v {
            serde_json::Value::Object(map) => {
                if map.get("type").and_then(|t| t.as_str()) == Some("prometheus") {
                    if let Some(uid) = map.get("uid") {
                        out.push(uid);
                    }
                }
                map.values().for_each(|x| prometheus_uids(x, out));
            }
            serde_json::Value::Array(items) => items.iter().for_each(|x| prometheus_uids(x, out)),
            _ => {}
        }
    }
    let mut uids = Vec::new();
    prometheus_uids(&json, &mut uids);
    assert!(
        !uids.is_empty(),
        "no Prometheus datasource reference in the dashboard"
    );
    assert!(uids.iter().all(|u| *u == uid), "{uids:?}");
}

/// Every compactor configuration the deployment files carry passes `compactor check-config`,
/// and listens where the probes, healthcheck and scrape configs expect it.
#[test]
fn shipped_configs_pass_check_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut checked = Vec::new();
    for path in files_under(&deploy_dir(), &["toml"]) {
        let what = path.strip_prefix(root()).unwrap().display().to_string();
        let config = check_config(&path, &what);
        // Containers: the probes, HEALTHCHECK and Prometheus come from outside the container.
        assert_eq!(
            config["server"]["listen"].as_str(),
            Some("0.0.0.0:8787"),
            "{what}"
        );
        checked.push((what, config));
    }
    for (file, doc) in k8s_docs() {
        if doc["kind"].as_str() != Some("ConfigMap") {
            continue;
        }
        let cm = str_of(&doc["metadata"]["name"], "ConfigMap name");
        for (key, value) in doc["data"].as_hash().into_iter().flatten() {
            let key = str_of(key, "ConfigMap key");
            if !key.ends_with(".toml") {
                continue;
            }
            let path = dir.path().join(format!("{cm}-{key}"));
            std::fs::write(&path, str_of(value, key)).expect("write config");
            let what = format!("deploy/kubernetes/{file}: ConfigMap {cm} {key}");
            let config = check_config(&path, &what);
            checked.push((what, config));
        }
    }
    let names: Vec<&str> = checked.iter().map(|(w, _)| w.as_str()).collect();
    assert_eq!(
        checked.len(),
        3,
        "expected deploy/compactor/compactor.toml and two ConfigMaps: {names:?}"
    );
    for (what, config) in &checked {
        let admin = config["server"]["admin_listen"]
            .as_str()
            .expect("admin_listen");
        assert_eq!(
            admin,
            format!("0.0.0.0:{ADMIN_PORT}"),
            "{what}: admin listener"
        );
    }
}

#[test]
fn dockerfile_is_multi_stage_non_root_with_a_livez_healthcheck() {
    let text = std::fs::read_to_string(root().join("Dockerfile")).expect("Dockerfile");
    // Instructions, with continuation lines joined and comments dropped.
    let joined = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("\\\n", " ");
    let instructions: Vec<&str> = joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let starting = |word: &str| -> Vec<&str> {
        instructions
            .iter()
            .copied()
            .filter(|l| l.split_whitespace().next() == Some(word))
            .collect()
    };
    assert!(starting("FROM").len() >= 2, "not multi-stage");
    assert!(
        starting("RUN")
            .iter()
            .any(|r| r.contains("cargo build --release --locked -p compactor")),
        "no locked release build"
    );
    let users = starting("USER");
    let user = users.last().expect("a USER instruction");
    let who = user
        .split_whitespace()
        .nth(1)
        .unwrap()
        .split(':')
        .next()
        .unwrap();
    assert!(who != "root" && who != "0", "runs as {who}");
    let health = starting("HEALTHCHECK");
    assert_eq!(health.len(), 1);
    assert!(
        health[0].contains(&format!("127.0.0.1:{ADMIN_PORT}/livez")),
        "{}",
        health[0]
    );
    assert!(
        starting("CMD").iter().any(|c| c.contains(CONFIG_PATH)),
        "CMD does not read {CONFIG_PATH}"
    );
    // An init as PID 1, installed: the exec summarizer's orphans are reaped.
    let entrypoint = starting("ENTRYPOINT");
    assert!(
        entrypoint.len() == 1 && entrypoint[0].contains(r#"["/usr/bin/tini", "--", "#),
        "{entrypoint:?}"
    );
    assert!(
        starting("RUN")
            .iter()
            .any(|r| r.contains("apt-get install") && r.contains(" tini")),
        "tini is not installed"
    );
    let copy = starting("COPY")
        .into_iter()
        .find(|c| c.contains(CONFIG_PATH))
        .expect("a default config copied to /etc/compactor");
    let source = format!("deploy/{COMPOSE_CONFIG}");
    assert!(copy.contains(&source), "{copy}");
    assert!(root().join(&source).is_file(), "{source} missing");
    let expose = starting("EXPOSE").join(" ");
    assert!(
        expose.contains("8787") && expose.contains(&ADMIN_PORT.to_string()),
        "{expose}"
    );

    let ignore = std::fs::read_to_string(root().join(".dockerignore")).expect(".dockerignore");
    for entry in ["target/", ".venv-sdk/", ".agents/", ".git"] {
        assert!(
            ignore.lines().any(|l| l.trim() == entry),
            ".dockerignore lacks {entry}"
        );
    }
}
