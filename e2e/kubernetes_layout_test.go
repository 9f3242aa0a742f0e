package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/manifest"
)

// podLayout is the DaemonSet's pod laid out under a temporary root: every
// mountPath of daemonset.yaml becomes root+mountPath, so the init
// container's script and the container's command run as they are, with
// only their absolute paths moved under root.
type podLayout struct {
	root   string
	mounts []string
}

func (p podLayout) rewrite(s string) string {
	// Longest first, so /run/bcd/join-token is not taken for a prefix.
	ms := slices.Clone(p.mounts)
	slices.SortFunc(ms, func(a, b string) int { return len(b) - len(a) })
	re := regexp.MustCompile(`(^|[\s"'=])(` + strings.Join(quoteAll(ms), "|") + `)\b`)
	return re.ReplaceAllString(s, "${1}"+p.root+"${2}")
}

func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = regexp.QuoteMeta(s)
	}
	return out
}

// daemonSet reads the pieces of daemonset.yaml the pod runs: its mount
// paths, the join init container's command and bcd's command.
func daemonSet(t *testing.T) (mounts []string, initCommand []string, command []string) {
	t.Helper()
	b, err := os.ReadFile(manifest.Path("base", "daemonset.yaml"))
	must(t, err)
	ds := string(b)
	for _, m := range regexp.MustCompile(`(?m)^\s*mountPath: (\S+)$`).FindAllStringSubmatch(ds, -1) {
		if !slices.Contains(mounts, m[1]) {
			mounts = append(mounts, m[1])
		}
	}
	initCmd := regexp.MustCompile(`(?m)^\s*- name: join\n\s*image: bcd\n\s*command: (\[.*\])$`).FindStringSubmatch(ds)
	if initCmd == nil {
		t.Fatal("daemonset.yaml: no init container join with a command [...]")
	}
	must(t, json.Unmarshal([]byte(initCmd[1]), &initCommand))
	cmd := regexp.MustCompile(`(?m)^\s*- name: bcd\n\s*image: bcd\n\s*command: (\[.*\])$`).FindStringSubmatch(ds)
	if cmd == nil {
		t.Fatal("daemonset.yaml: no container bcd with a command [...]")
	}
	must(t, json.Unmarshal([]byte(cmd[1]), &command))
	return mounts, initCommand, command
}

// R18.3: the DaemonSet's pod, simulated: its ConfigMap's config.toml with
// the control plane's pins, site and gateway filled in, the hosted token as
// the Secret's 0400 file in a read-only directory, a fake /host/sys; the
// init container's own command (the image has no shell) joins the host against a real dev control
// plane, the container's own command then runs bcd until its readiness
// probe answers, and a restarted pod's init container joins no more.
func TestKubernetesDaemonSetLayoutR18_3(t *testing.T) {
	bc, bcd := binaries(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "bc-dev")
	env := startDev(t, bc, data, filepath.Join(data, "bcd", "config.toml"))
	devConf := readFile(t, filepath.Join(data, "bcd", "config.toml"))

	mounts, initCommand, command := daemonSet(t)
	pod := podLayout{root: filepath.Join(dir, "pod"), mounts: mounts}
	for _, m := range []string{"/run/bcd/join-token", "/config", "/etc/bcd", "/var/lib/bcd", "/host/sys"} {
		if !slices.Contains(mounts, m) {
			t.Fatalf("daemonset.yaml mounts %v, no %s", mounts, m)
		}
		must(t, os.MkdirAll(pod.root+m, 0o755))
	}
	fakeSysfs(t, pod.root+"/host/sys", "SN-K8S-1", "6b8b4567-327b-23c6-643c-986966334873", "3c:ec:ef:0b:0c:0d")

	// The ConfigMap's config.toml, its placeholders filled from dev's.
	conf, err := manifest.ConfigMapFile("config.toml", "base", "configmap.yaml")
	must(t, err)
	for _, key := range []string{"gateway_url", "site", "serving_ca_spki_pin", "join_signing_key_pin", "join_encryption_key_pin"} {
		line := regexp.MustCompile(`(?m)^` + key + ` = .*$`)
		devLine := line.FindString(devConf)
		if devLine == "" || !line.MatchString(conf) {
			t.Fatalf("%s: in dev's config %q, in the ConfigMap's %v", key, devLine, line.MatchString(conf))
		}
		conf = line.ReplaceAllLiteralString(conf, devLine)
	}
	// The diagnostics listener on the port the kernel picks, read from
	// bcd run's log.
	if !strings.Contains(conf, `listen = "127.0.0.1:9464"`) {
		t.Fatalf("the ConfigMap's diagnostics listener moved:\n%s", conf)
	}
	conf = strings.Replace(conf, `listen = "127.0.0.1:9464"`, `listen = "127.0.0.1:0"`, 1)
	must(t, os.WriteFile(pod.root+"/config/config.toml", []byte(pod.rewrite(conf)), 0o644))

	// The hosted token, as the Secret's file: 0400, in a read-only mount.
	tokenDir := pod.root + "/run/bcd/join-token"
	token(t, bc, env, filepath.Join(dir, "token"), "--hosted", "kubernetes", "--max-uses", "2")
	must(t, os.WriteFile(tokenDir+"/token", []byte(readFile(t, filepath.Join(dir, "token"))), 0o400))
	must(t, os.Chmod(tokenDir, 0o500))
	t.Cleanup(func() { _ = os.Chmod(tokenDir, 0o700) })

	// The ConfigMap's server-ca.pem: dev's private CA (R24.1).
	must(t, os.WriteFile(pod.root+"/config/server-ca.pem", []byte(readFile(t, env["BETTER_COMPUTE_CA_FILE"])), 0o644))

	// The image: bcd on PATH. Kubernetes expands $(BCD_SERVER) from the
	// container's env.
	podEnv := []string{"PATH=" + filepath.Dir(bcd) + ":" + os.Getenv("PATH"), "BCD_SERVER=" + env["BETTER_COMPUTE_URL"]}
	initArgs := strings.Fields(strings.ReplaceAll(pod.rewrite(strings.Join(initCommand[1:], " ")), "$(BCD_SERVER)", env["BETTER_COMPUTE_URL"]))
	initBin := filepath.Join(filepath.Dir(bcd), initCommand[0])
	out, errOut, code := run(t, podEnv, "", initBin, initArgs...)
	id := nodeIDRE.FindStringSubmatch(out + errOut)
	if code != 0 || id == nil {
		t.Fatalf("the init container: %d\n%s\n%s\ncommand: %v", code, out, errOut, initArgs)
	}
	if _, err := os.Stat(pod.root + "/etc/bcd/config.toml"); err != nil {
		t.Fatalf("the init container did not seed the host's config: %v", err)
	}

	// The container: the DaemonSet's command, until its readiness probe.
	args := strings.Fields(pod.rewrite(strings.Join(command[1:], " ")))
	daemon := start(t, podEnv, filepath.Join(filepath.Dir(bcd), command[0]), args...)
	diag := logged(t, daemon, readyLine(`diagnostics listening`, "addr"), "bcd run's diagnostics listener")
	waitFor(t, "bcd run ready on its diagnostics listener", 60*time.Second, func() bool {
		code, _ := httpGet("http://" + diag + "/readyz")
		return code == 200
	})
	if code, body := httpGet("http://" + diag + "/livez"); code != 200 {
		t.Fatalf("livez %d %s", code, body)
	}
	waitFor(t, "the node adopted", 30*time.Second, func() bool {
		out, _, _ := run(t, envList(env), "", bc, "nodes", "get", id[1], "--tenant", env["TENANT"], "--json")
		return strings.Contains(out, `"adopted"`)
	})

	// A restarted pod: the init container sees the identity and spends
	// nothing.
	out, errOut, code = run(t, podEnv, "", initBin, initArgs...)
	if code != 0 || !strings.Contains(out+errOut, "already joined") || nodeIDRE.MatchString(out+errOut) {
		t.Fatalf("the init container of a restarted pod: %d %s %s", code, out, errOut)
	}
}

// deployment reads a control-plane manifest's mount paths and its one
// container's command.
func deployment(t *testing.T, file string) (mounts, command []string) {
	t.Helper()
	yaml := readFile(t, manifest.Path("control-plane", file))
	for _, m := range regexp.MustCompile(`(?m)^\s*mountPath: (\S+)$`).FindAllStringSubmatch(yaml, -1) {
		mounts = append(mounts, m[1])
	}
	cmd := regexp.MustCompile(`(?m)^\s*command: (\[.*\])$`).FindStringSubmatch(yaml)
	if cmd == nil {
		t.Fatalf("%s: no command [...]", file)
	}
	must(t, json.Unmarshal([]byte(cmd[1]), &command))
	return mounts, command
}

// secretFiles writes files (mount path → content) as a Secret volume
// holds them: 0440, read-only directories.
func secretFiles(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for p, content := range files {
		must(t, os.MkdirAll(filepath.Dir(root+p), 0o755))
		must(t, os.WriteFile(root+p, []byte(content), 0o440))
	}
}

// replaceListen replaces the line listen = "<addr>" of a TOML file (the
// first one) with port 0 on the loopback address.
func replaceListen(t *testing.T, toml, addr string) string {
	t.Helper()
	line := `listen = "` + addr + `"`
	if !strings.Contains(toml, line) {
		t.Fatalf("no %s in\n%s", line, toml)
	}
	return strings.Replace(toml, line, `listen = "127.0.0.1:0"`, 1)
}

// setLine replaces the line `key = …` of a TOML file (the first one).
func setLine(t *testing.T, toml, key, value string) string {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(key) + ` = .*$`)
	if !re.MatchString(toml) {
		t.Fatalf("no %s in\n%s", key, toml)
	}
	done := false
	return re.ReplaceAllStringFunc(toml, func(l string) string {
		if done {
			return l
		}
		done = true
		return key + " = " + value
	})
}

// R18.3: the control plane's pods, simulated: serve and the gateway run
// the Deployments' commands on the ConfigMap's serve.toml and gateway.toml,
// with the Secrets' files at their mount paths, and both readiness probes
// (the metrics listeners' /readyz) answer: serve's database takes writes,
// the gateway reaches serve's agent listener over mTLS. Only the listen
// addresses move to port 0 (the bound ones are read from the JSON logs,
// serve's before the gateway's config names its agent listener) and the
// DSN to the test's PostgreSQL (keeping passfile=, the Secret's pgpass).
func TestKubernetesControlPlaneLayoutR18_3(t *testing.T) {
	dsn := storetest.PostgresDSN(t)
	bc, _ := binaries(t)
	dir := t.TempDir()
	secretEnv, _ := initPKI(t, bc, dir)
	serveMounts, serveCmd := deployment(t, "serve.yaml")
	gwMounts, gwCmd := deployment(t, "gateway.yaml")
	if serveCmd[0] != "better-compute" || gwCmd[0] != "better-compute" {
		t.Fatalf("commands %v %v: the image's binary is better-compute", serveCmd, gwCmd)
	}
	if !strings.Contains(readFile(t, manifest.Path("control-plane", "serve.yaml")), "- name: BETTER_COMPUTE_SECRET") {
		t.Fatal("serve.yaml does not hand serve BETTER_COMPUTE_SECRET")
	}
	servePod := podLayout{root: filepath.Join(dir, "serve-pod"), mounts: serveMounts}
	gwPod := podLayout{root: filepath.Join(dir, "gateway-pod"), mounts: gwMounts}

	pkiFiles := map[string]string{}
	entries, err := os.ReadDir(filepath.Join(dir, "pki"))
	must(t, err)
	for _, e := range entries {
		pkiFiles["/etc/better-compute/pki/"+e.Name()] = readFile(t, filepath.Join(dir, "pki", e.Name()))
	}
	pkiFiles["/etc/better-compute/tls/tls.crt"] = readFile(t, filepath.Join(dir, "gateway.crt"))
	pkiFiles["/etc/better-compute/tls/tls.key"] = readFile(t, filepath.Join(dir, "gateway.key"))
	pkiFiles["/etc/better-compute/agent/tls.crt"] = readFile(t, filepath.Join(dir, "agent.crt"))
	pkiFiles["/etc/better-compute/agent/tls.key"] = readFile(t, filepath.Join(dir, "agent.key"))
	pkiFiles["/etc/better-compute/postgres/pgpass"] = "*:*:*:*:unused-with-trust-auth\n"
	secretFiles(t, servePod.root, pkiFiles)
	secretFiles(t, gwPod.root, map[string]string{
		"/etc/better-compute/tls/tls.crt":               pkiFiles["/etc/better-compute/tls/tls.crt"],
		"/etc/better-compute/tls/tls.key":               pkiFiles["/etc/better-compute/tls/tls.key"],
		"/etc/better-compute/serving-ca/serving-ca.crt": pkiFiles["/etc/better-compute/pki/serving-ca.crt"],
	})

	const anyPort = `"127.0.0.1:0"`
	serveTOML, err := manifest.ConfigMapFile("serve.toml", "control-plane", "configmap.yaml")
	must(t, err)
	if !strings.Contains(serveTOML, "passfile=/etc/better-compute/postgres/pgpass") {
		t.Fatal("serve.toml's DSN does not read the pgpass Secret")
	}
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	serveTOML = setLine(t, serveTOML, "listen", anyPort)
	serveTOML = setLine(t, serveTOML, "dsn", `"`+dsn+sep+`passfile=/etc/better-compute/postgres/pgpass"`)
	serveTOML = replaceListen(t, serveTOML, ":8444")
	serveTOML = replaceListen(t, serveTOML, ":9090")
	secretFiles(t, servePod.root, map[string]string{"/etc/better-compute/config/serve.toml": servePod.rewrite(serveTOML)})
	serveArgs := strings.Fields(servePod.rewrite(strings.Join(serveCmd[1:], " ")))
	serve := start(t, []string{secretEnv[0]}, bc, serveArgs...)
	agent := listened(t, serve, "agent listener (gateways, mTLS)")
	serveMetrics := listened(t, serve, "metrics listening")

	gwTOML, err := manifest.ConfigMapFile("gateway.toml", "control-plane", "configmap.yaml")
	must(t, err)
	gwTOML = setLine(t, gwTOML, "listen", anyPort)
	gwTOML = setLine(t, gwTOML, "api_url", `"https://`+agent+`"`)
	gwTOML = replaceListen(t, gwTOML, ":9465")
	secretFiles(t, gwPod.root, map[string]string{"/etc/better-compute/config/gateway.toml": gwPod.rewrite(gwTOML)})
	gwArgs := strings.Fields(gwPod.rewrite(strings.Join(gwCmd[1:], " ")))
	gateway := start(t, nil, bc, gwArgs...)
	listened(t, gateway, "gateway listening")
	gwMetrics := listened(t, gateway, "gateway metrics listening")
	for name, addr := range map[string]string{"serve": serveMetrics, "gateway": gwMetrics} {
		waitFor(t, name+"'s readiness probe", 60*time.Second, func() bool {
			code, _ := httpGet("http://" + addr + "/readyz")
			return code == 200
		})
		if code, body := httpGet("http://" + addr + "/livez"); code != 200 {
			t.Fatalf("%s livez %d %s", name, code, body)
		}
	}
}
