package check

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"
)

// kustomization is the part of kustomize's file these manifests use;
// decoded strictly, so a misspelt key fails here.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Namespace  string   `json:"namespace,omitempty"`
	Resources  []string `json:"resources"`
	Patches    []struct {
		Path string `json:"path"`
	} `json:"patches,omitempty"`
	Images []image `json:"images,omitempty"`
}

// image is one of kustomize's image replacements.
type image struct {
	Name    string `json:"name"`
	NewName string `json:"newName"`
	NewTag  string `json:"newTag"`
}

const (
	base       = "../base"
	tpmOverlay = "../overlays/tpm"
	tokenPath  = "/run/bcd/join-token"
)

var strict = serializer.NewCodecFactory(scheme.Scheme, serializer.EnableStrict).UniversalDeserializer()

func readKustomization(t *testing.T, dir string) kustomization {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k kustomization
	if err := yaml.UnmarshalStrict(b, &k); err != nil {
		t.Fatalf("%s/kustomization.yaml: %v", dir, err)
	}
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		t.Fatalf("%s/kustomization.yaml: %s %s", dir, k.APIVersion, k.Kind)
	}
	return k
}

// decode decodes one manifest strictly: unknown or duplicate fields and
// kinds client-go does not know fail.
func decode(t *testing.T, name string, b []byte) runtime.Object {
	t.Helper()
	obj, _, err := strict.Decode(b, nil, nil)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return obj
}

// loadBase decodes every resource of the base (loadDir), by kind.
func loadBase(t *testing.T) map[string]runtime.Object {
	t.Helper()
	objs := map[string]runtime.Object{}
	for _, obj := range loadDir(t, base) {
		objs[obj.GetObjectKind().GroupVersionKind().Kind] = obj
	}
	return objs
}

func namespaceOf(obj runtime.Object) string {
	if m, ok := obj.(interface{ GetNamespace() string }); ok {
		return m.GetNamespace()
	}
	return ""
}

// R18.3: the base decodes strictly, and the DaemonSet keeps the hosted
// token safe: a Secret mounted read-only with defaultMode 0400, read with
// --token-file, never in argv or env (R11.2); the host's /sys read-only;
// probes on bcd's diagnostics listener.
func TestBase(t *testing.T) {
	objs := loadBase(t)
	ds, ok := objs["DaemonSet"].(*appsv1.DaemonSet)
	if !ok {
		t.Fatalf("no DaemonSet in the base: %v", objs)
	}
	cm, ok := objs["ConfigMap"].(*corev1.ConfigMap)
	if !ok {
		t.Fatal("no ConfigMap in the base")
	}
	checkDaemonSet(t, ds, diagnosticsPort(t, cm))
	spec := ds.Spec.Template.Spec
	k := readKustomization(t, base)
	for _, c := range allContainers(spec) {
		if !slices.ContainsFunc(k.Images, func(i image) bool { return i.Name == c.Image && i.NewName != "" && i.NewTag != "" }) {
			t.Errorf("container %s: image %q is not set by the kustomization's images", c.Name, c.Image)
		}
	}
	for _, c := range allContainers(spec) {
		sc := c.SecurityContext
		if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Privileged != nil && *sc.Privileged ||
			sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
			t.Errorf("container %s: securityContext %+v is not minimal", c.Name, sc)
		}
	}
	if sa, ok := objs["ServiceAccount"].(*corev1.ServiceAccount); !ok || sa.AutomountServiceAccountToken == nil || *sa.AutomountServiceAccountToken {
		t.Error("the ServiceAccount mounts an API token")
	}
}

// diagnosticsPort is the port of [diagnostics] listen in the ConfigMap's
// config.toml, which must listen on loopback.
func diagnosticsPort(t *testing.T, cm *corev1.ConfigMap) int32 {
	t.Helper()
	conf := cm.Data["config.toml"]
	m := regexp.MustCompile(`(?m)^\[diagnostics\]\s*\nlisten = "127\.0\.0\.1:(\d+)"$`).FindStringSubmatch(conf)
	if m == nil {
		t.Fatalf("config.toml has no [diagnostics] listen on 127.0.0.1:\n%s", conf)
	}
	if !strings.HasPrefix(cm.Data["server"], "https://") {
		t.Errorf("server %q is not an https URL", cm.Data["server"])
	}
	if !strings.Contains(conf, `sysfs_root = "/host/sys"`) {
		t.Error(`config.toml does not read the claims from the mounted host /sys (sysfs_root = "/host/sys")`)
	}
	p, _ := strconv.Atoi(m[1])
	return int32(p)
}

func allContainers(spec corev1.PodSpec) []corev1.Container {
	return append(slices.Clone(spec.InitContainers), spec.Containers...)
}

func checkDaemonSet(t *testing.T, ds *appsv1.DaemonSet, port int32) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	if !spec.HostNetwork || spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Errorf("hostNetwork %v, automountServiceAccountToken %v: want the host's network and no API token", spec.HostNetwork, spec.AutomountServiceAccountToken)
	}
	vols := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		vols[v.Name] = v
	}
	var tokenVol, sysVol string
	for name, v := range vols {
		if v.Secret != nil {
			tokenVol = name
			if v.Secret.DefaultMode == nil {
				t.Errorf("secret volume %s: no defaultMode, want 0400", name)
			} else if *v.Secret.DefaultMode != 0o400 {
				t.Errorf("secret volume %s: defaultMode %#o, want 0400", name, *v.Secret.DefaultMode)
			}
			for _, it := range v.Secret.Items {
				if it.Mode != nil && *it.Mode != 0o400 {
					t.Errorf("secret volume %s: item %s mode %o", name, it.Key, *it.Mode)
				}
			}
		}
		if v.HostPath != nil && v.HostPath.Path == "/sys" {
			sysVol = name
		}
	}
	if tokenVol == "" || sysVol == "" {
		t.Fatalf("volumes %v: want the token Secret and the host's /sys", vols)
	}
	joins := 0
	for _, c := range allContainers(spec) {
		for _, m := range c.VolumeMounts {
			if (m.Name == tokenVol || m.Name == sysVol) && !m.ReadOnly {
				t.Errorf("container %s mounts %s read-write", c.Name, m.Name)
			}
		}
		checkNoTokenInArgsOrEnv(t, c, tokenVol)
		if c.Resources.Limits.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
			t.Errorf("container %s has no CPU and memory limits", c.Name)
		}
		if strings.Contains(strings.Join(append(slices.Clone(c.Command), c.Args...), " "), "bcd join") {
			joins++
		}
	}
	if joins != 1 {
		t.Errorf("%d containers run bcd join, want the one init container", joins)
	}
	probes := 0
	for _, c := range spec.Containers {
		for kind, p := range map[string]*corev1.Probe{"startup": c.StartupProbe, "liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
			if p == nil {
				t.Errorf("container %s has no %s probe", c.Name, kind)
				continue
			}
			want := map[string]string{"readiness": "/readyz"}[kind]
			if want == "" {
				want = "/livez"
			}
			if g := p.HTTPGet; g == nil || g.Host != "127.0.0.1" || g.Port.IntValue() != int(port) || g.Path != want {
				t.Errorf("container %s: %s probe %+v, want GET http://127.0.0.1:%d%s", c.Name, kind, p.ProbeHandler, port, want)
			}
			probes++
		}
	}
	if probes != 3 {
		t.Errorf("%d probes, want startup, liveness and readiness", probes)
	}
	for _, c := range allContainers(spec) {
		// The API server refuses a privileged container that may not
		// escalate; strict decoding does not validate, so check it here.
		if sc := c.SecurityContext; sc != nil && sc.Privileged != nil && *sc.Privileged && sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation {
			t.Errorf("container %s: privileged with allowPrivilegeEscalation false is invalid", c.Name)
		}
	}
}

// checkNoTokenInArgsOrEnv: the token reaches bcd only as the mounted file.
func checkNoTokenInArgsOrEnv(t *testing.T, c corev1.Container, tokenVol string) {
	t.Helper()
	argv := strings.Join(append(slices.Clone(c.Command), c.Args...), " ")
	for _, bad := range []string{"bcjt_", "BCD_JOIN_TOKEN", "--token "} {
		if strings.Contains(argv, bad) {
			t.Errorf("container %s: %q in its command line", c.Name, bad)
		}
	}
	mounted := slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == tokenVol })
	if mounted != strings.Contains(argv, "--token-file "+tokenPath+"/token") {
		t.Errorf("container %s: the token is mounted (%v) where bcd join --token-file %s/token does not read it", c.Name, mounted, tokenPath)
	}
	for _, e := range c.Env {
		if e.Name == "BCD_JOIN_TOKEN" || e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
			t.Errorf("container %s: env %s carries a secret", c.Name, e.Name)
		}
	}
	for _, e := range c.EnvFrom {
		if e.SecretRef != nil {
			t.Errorf("container %s: envFrom a Secret", c.Name)
		}
	}
}

// R18.3: the TPM overlay, applied to the base as kustomize's strategic
// merge does, decodes strictly, hands both containers /dev/tpmrm0 and keeps
// every property of the base's token and probes.
func TestTPMOverlay(t *testing.T) {
	objs := loadBase(t)
	ds := objs["DaemonSet"].(*appsv1.DaemonSet)
	k := readKustomization(t, tpmOverlay)
	if !slices.Equal(k.Resources, []string{"../../base"}) || len(k.Patches) != 1 {
		t.Fatalf("overlay: resources %v, patches %v", k.Resources, k.Patches)
	}
	patchYAML, err := os.ReadFile(filepath.Join(tpmOverlay, k.Patches[0].Path))
	if err != nil {
		t.Fatal(err)
	}
	decode(t, k.Patches[0].Path, patchYAML) // the patch itself is a valid DaemonSet
	patch, err := yaml.YAMLToJSON(patchYAML)
	if err != nil {
		t.Fatal(err)
	}
	orig, err := json.Marshal(ds)
	if err != nil {
		t.Fatal(err)
	}
	merged, err := strategicpatch.StrategicMergePatch(orig, patch, appsv1.DaemonSet{})
	if err != nil {
		t.Fatal(err)
	}
	out, ok := decode(t, "base+tpm", merged).(*appsv1.DaemonSet)
	if !ok {
		t.Fatal("the overlay does not make a DaemonSet")
	}
	checkDaemonSet(t, out, diagnosticsPort(t, objs["ConfigMap"].(*corev1.ConfigMap)))
	spec := out.Spec.Template.Spec
	if !slices.ContainsFunc(spec.Volumes, func(v corev1.Volume) bool {
		return v.HostPath != nil && v.HostPath.Path == "/dev/tpmrm0" && v.HostPath.Type != nil && *v.HostPath.Type == corev1.HostPathCharDev
	}) {
		t.Errorf("no /dev/tpmrm0 character device volume: %+v", spec.Volumes)
	}
	for _, c := range allContainers(spec) {
		if !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == "/dev/tpmrm0" }) {
			t.Errorf("container %s does not see /dev/tpmrm0", c.Name)
		}
		if len(c.VolumeMounts) <= 2 {
			t.Errorf("container %s lost the base's mounts: %+v", c.Name, c.VolumeMounts)
		}
	}
}
