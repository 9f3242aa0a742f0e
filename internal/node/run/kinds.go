package run

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Facts is the output of node.facts.
type Facts struct {
	CPUs        int    `json:"cpus"`
	MemoryBytes int64  `json:"memoryBytes"`
	GPUs        int    `json:"gpus"`
	Hostname    string `json:"hostname"`
}

// AcceptanceArgs are acceptance.check's arguments: the pool's acceptance
// policy.
type AcceptanceArgs struct {
	MinCPUs        int64 `json:"minCpus"`
	MinMemoryBytes int64 `json:"minMemoryBytes"`
	MinGPUs        int64 `json:"minGpus"`
}

// AcceptanceResult is acceptance.check's output: every check, pass or fail.
type AcceptanceResult struct {
	Pass   bool    `json:"pass"`
	Checks []Check `json:"checks"`
	Facts  Facts   `json:"facts"`
}

// Check is one acceptance check.
type Check struct {
	Name string `json:"name"`
	Want int64  `json:"want"`
	Have int64  `json:"have"`
	Pass bool   `json:"pass"`
}

// Execute runs a built-in kind and returns its JSON output.
func Execute(_ context.Context, procfs, kind string, args []byte) ([]byte, error) {
	switch kind {
	case wire.KindNodeFacts:
		f, err := ReadFacts(procfs)
		if err != nil {
			return nil, err
		}
		return json.Marshal(f)
	case wire.KindAcceptanceCheck:
		var a AcceptanceArgs
		dec := json.NewDecoder(bytes.NewReader(args))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&a); err != nil {
			return nil, fmt.Errorf("acceptance.check args: %v", err)
		}
		f, err := ReadFacts(procfs)
		if err != nil {
			return nil, err
		}
		return json.Marshal(Accept(a, f))
	default:
		return nil, fmt.Errorf("unknown command kind %q", kind)
	}
}

// Accept compares facts with the acceptance policy.
func Accept(a AcceptanceArgs, f Facts) AcceptanceResult {
	r := AcceptanceResult{Pass: true, Facts: f}
	for _, c := range []Check{
		{Name: "minCpus", Want: a.MinCPUs, Have: int64(f.CPUs)},
		{Name: "minMemoryBytes", Want: a.MinMemoryBytes, Have: f.MemoryBytes},
		{Name: "minGpus", Want: a.MinGPUs, Have: int64(f.GPUs)},
	} {
		c.Pass = c.Have >= c.Want
		r.Pass = r.Pass && c.Pass
		r.Checks = append(r.Checks, c)
	}
	return r
}

// ReadFacts reads the node's facts under procfs: processors from
// <procfs>/cpuinfo (runtime.NumCPU when it lists none), MemTotal from
// <procfs>/meminfo, NVIDIA GPUs from <procfs>/driver/nvidia/gpus, the
// hostname from <procfs>/sys/kernel/hostname (else os.Hostname).
func ReadFacts(procfs string) (Facts, error) {
	if procfs == "" {
		procfs = "/proc"
	}
	var f Facts
	if b, err := os.ReadFile(filepath.Join(procfs, "cpuinfo")); err == nil {
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			if k, _, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "processor" {
				f.CPUs++
			}
		}
	}
	if f.CPUs == 0 {
		f.CPUs = runtime.NumCPU()
	}
	b, err := os.ReadFile(filepath.Join(procfs, "meminfo"))
	if err != nil {
		return f, fmt.Errorf("read memory: %v", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return f, fmt.Errorf("read memory: MemTotal %q", fields[1])
			}
			f.MemoryBytes = kb * 1024
		}
	}
	if ents, err := os.ReadDir(filepath.Join(procfs, "driver", "nvidia", "gpus")); err == nil {
		for _, e := range ents {
			if e.IsDir() {
				f.GPUs++
			}
		}
	}
	if b, err := os.ReadFile(filepath.Join(procfs, "sys", "kernel", "hostname")); err == nil {
		f.Hostname = strings.TrimSpace(string(b))
	}
	if f.Hostname == "" {
		f.Hostname, _ = os.Hostname()
	}
	return f, nil
}
