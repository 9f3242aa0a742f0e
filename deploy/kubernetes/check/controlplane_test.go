package check

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
)

const controlPlane = "../control-plane"

// loadDir decodes every resource of a kustomization strictly, and checks
// that it lists exactly the manifests of its directory and that each is in
// its namespace.
func loadDir(t *testing.T, dir string) []runtime.Object {
	t.Helper()
	k := readKustomization(t, dir)
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var onDisk []string
	for _, f := range files {
		if filepath.Base(f) != "kustomization.yaml" {
			onDisk = append(onDisk, filepath.Base(f))
		}
	}
	if listed := slices.Sorted(slices.Values(k.Resources)); !slices.Equal(listed, onDisk) {
		t.Fatalf("kustomization resources %v, directory %v", listed, onDisk)
	}
	var objs []runtime.Object
	for _, r := range k.Resources {
		b, err := os.ReadFile(filepath.Join(dir, r))
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range bytes.Split(b, []byte("\n---\n")) {
			obj := decode(t, r+"#"+strconv.Itoa(i), doc)
			kind := obj.GetObjectKind().GroupVersionKind().Kind
			if ns := namespaceOf(obj); ns != k.Namespace && kind != "Namespace" {
				t.Errorf("%s: %s in namespace %q, the kustomization's is %q", r, kind, ns, k.Namespace)
			}
			if kind == "Secret" {
				t.Errorf("%s ships a Secret: tokens, keys, certificates and passwords are the operator's, created with kubectl", r)
			}
			objs = append(objs, obj)
		}
	}
	return objs
}

func ofKind[T runtime.Object](objs []runtime.Object) []T {
	var out []T
	for _, o := range objs {
		if v, ok := o.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

// R18.3: the control plane's manifests decode strictly; serve and the
// gateway run as two non-root replicas with a read-only root filesystem,
// no capability and no secret in their arguments or environment values;
// their probes ask the port of [metrics] listen; a PodDisruptionBudget
// keeps one of each; Secrets are mounted read-only.
func TestControlPlane(t *testing.T) {
	objs := loadDir(t, controlPlane)
	k := readKustomization(t, controlPlane)
	cms := ofKind[*corev1.ConfigMap](objs)
	if len(cms) != 1 {
		t.Fatalf("%d ConfigMaps, want better-compute-config", len(cms))
	}
	deps := ofKind[*appsv1.Deployment](objs)
	pdbs := ofKind[*policyv1.PodDisruptionBudget](objs)
	svcs := ofKind[*corev1.Service](objs)
	names := map[string]string{"better-compute-serve": "serve.toml", "better-compute-gateway": "gateway.toml"}
	if len(deps) != len(names) {
		t.Fatalf("%d Deployments, want serve and gateway", len(deps))
	}
	for _, d := range deps {
		key, ok := names[d.Name]
		if !ok {
			t.Fatalf("unexpected Deployment %s", d.Name)
		}
		t.Run(d.Name, func(t *testing.T) {
			checkDeployment(t, d, metricsPort(t, cms[0].Data[key]), key)
			pods := labels.Set(d.Spec.Template.Labels)
			if n := countSelecting(t, pdbs, pods); n != 1 {
				t.Errorf("%d PodDisruptionBudgets select its pods, want 1", n)
			}
			served := slices.ContainsFunc(svcs, func(s *corev1.Service) bool {
				return labels.SelectorFromSet(s.Spec.Selector).Matches(pods)
			})
			if !served {
				t.Error("no Service selects its pods")
			}
			for _, c := range d.Spec.Template.Spec.Containers {
				if !slices.ContainsFunc(k.Images, func(i image) bool { return i.Name == c.Image && i.NewName != "" && i.NewTag != "" }) {
					t.Errorf("container %s: image %q is not set by the kustomization's images", c.Name, c.Image)
				}
			}
		})
	}
	for _, s := range svcs {
		sel := labels.SelectorFromSet(s.Spec.Selector)
		if !slices.ContainsFunc(deps, func(d *appsv1.Deployment) bool { return sel.Matches(labels.Set(d.Spec.Template.Labels)) }) {
			t.Errorf("Service %s selects no Deployment's pods", s.Name)
		}
	}
}

func countSelecting(t *testing.T, pdbs []*policyv1.PodDisruptionBudget, pods labels.Set) int {
	t.Helper()
	n := 0
	for _, p := range pdbs {
		sel, err := v1.LabelSelectorAsSelector(p.Spec.Selector)
		if err != nil {
			t.Fatalf("PodDisruptionBudget %s: %v", p.Name, err)
		}
		if sel.Matches(pods) {
			n++
			if p.Spec.MinAvailable == nil || p.Spec.MinAvailable.IntValue() != 1 {
				t.Errorf("PodDisruptionBudget %s: minAvailable %v, want 1", p.Name, p.Spec.MinAvailable)
			}
		}
	}
	return n
}

// metricsPort is the port of [metrics] listen in a TOML config, which must
// listen on every address (the kubelet probes the pod's IP).
func metricsPort(t *testing.T, conf string) int32 {
	t.Helper()
	m := regexp.MustCompile(`(?m)^\[metrics\]\s*\nlisten = ":(\d+)"$`).FindStringSubmatch(conf)
	if m == nil {
		t.Fatalf("no [metrics] listen = \":port\" in\n%s", conf)
	}
	p, _ := strconv.Atoi(m[1])
	return int32(p)
}

func checkDeployment(t *testing.T, d *appsv1.Deployment, metrics int32, configKey string) {
	t.Helper()
	if d.Spec.Replicas == nil || *d.Spec.Replicas < 2 {
		t.Errorf("replicas %v, want at least 2", d.Spec.Replicas)
	}
	spec := d.Spec.Template.Spec
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken || spec.HostNetwork {
		t.Error("the pod mounts an API token or uses the host's network")
	}
	psc := spec.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser != 65532 ||
		psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod securityContext %+v: want runAsNonRoot, runAsUser 65532 and seccomp RuntimeDefault", psc)
	}
	secretVols := map[string]bool{}
	for _, v := range spec.Volumes {
		if v.HostPath != nil {
			t.Errorf("volume %s is a hostPath", v.Name)
		}
		if v.Secret != nil {
			secretVols[v.Name] = true
		}
	}
	if len(spec.Containers) != 1 || len(spec.InitContainers) != 0 {
		t.Fatalf("%d containers, %d init containers: want one container", len(spec.Containers), len(spec.InitContainers))
	}
	c := spec.Containers[0]
	checkRestricted(t, c)
	checkNoSecretInArgsOrEnv(t, c)
	if argv := strings.Join(append(slices.Clone(c.Command), c.Args...), " "); !strings.HasSuffix(argv, "--config /etc/better-compute/config/"+configKey) {
		t.Errorf("command %q does not read the ConfigMap's %s", argv, configKey)
	}
	for _, m := range c.VolumeMounts {
		if secretVols[m.Name] && !m.ReadOnly {
			t.Errorf("Secret volume %s is mounted read-write", m.Name)
		}
	}
	if c.Resources.Limits.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() ||
		c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
		t.Error("no CPU and memory requests and limits")
	}
	metricsName := ""
	for _, p := range c.Ports {
		if p.ContainerPort == metrics {
			metricsName = p.Name
		}
	}
	if metricsName == "" {
		t.Fatalf("no container port %d ([metrics] listen)", metrics)
	}
	for kind, want := range map[string]string{"startup": "/livez", "liveness": "/livez", "readiness": "/readyz"} {
		p := map[string]*corev1.Probe{"startup": c.StartupProbe, "liveness": c.LivenessProbe, "readiness": c.ReadinessProbe}[kind]
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != want || p.HTTPGet.Port.String() != metricsName && p.HTTPGet.Port.IntValue() != int(metrics) {
			t.Errorf("%s probe %+v, want GET %s on the metrics port %d", kind, p, want, metrics)
		}
	}
}

// checkRestricted: non-root, nothing to escalate to, no capability, a
// read-only root filesystem.
func checkRestricted(t *testing.T, c corev1.Container) {
	t.Helper()
	sc := c.SecurityContext
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser == 0 ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Privileged != nil && *sc.Privileged ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) > 0 {
		t.Errorf("container %s: securityContext %+v is not restricted", c.Name, sc)
	}
}

// checkNoSecretInArgsOrEnv: secrets reach the processes as mounted files;
// the one exception is BETTER_COMPUTE_SECRET, which serve reads only from
// its environment, and then from a Secret, never as a literal value.
func checkNoSecretInArgsOrEnv(t *testing.T, c corev1.Container) {
	t.Helper()
	argv := strings.Join(append(slices.Clone(c.Command), c.Args...), " ")
	for _, bad := range []string{"password", "postgres://", "secret", "bcak_", "BEGIN "} {
		if strings.Contains(strings.ToLower(argv), strings.ToLower(bad)) {
			t.Errorf("container %s: %q in its command line", c.Name, bad)
		}
	}
	for _, e := range c.Env {
		if e.Value != "" && (strings.Contains(strings.ToUpper(e.Name), "SECRET") || strings.Contains(strings.ToUpper(e.Name), "PASSWORD") || strings.Contains(e.Value, "://")) {
			t.Errorf("container %s: env %s has a literal value", c.Name, e.Name)
		}
		if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil && e.Name != "BETTER_COMPUTE_SECRET" {
			t.Errorf("container %s: env %s comes from a Secret; mount it as a file", c.Name, e.Name)
		}
	}
	for _, e := range c.EnvFrom {
		if e.SecretRef != nil {
			t.Errorf("container %s: envFrom a Secret", c.Name)
		}
	}
}
