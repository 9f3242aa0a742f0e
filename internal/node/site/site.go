// Package site is bcd's site-agent side (R10.4): the machines the site
// booted over the network, as its boot module records them, which bcd run
// reports to the control plane when its identity has role site. Each report
// is signed by the site agent's node key over its session (SiteReport), so a
// relay can neither forge nor alter a vouch.
//
// The site's boot module (a DHCP/PXE hook, or `bcd site vouch` by hand)
// appends one JSON line per boot to the booted file; the newest line for a
// MAC wins, and a line with an older lease epoch than one already seen for
// that MAC is ignored, as the control plane ignores it too.
package site

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"

	"github.com/better-compute/better-compute/internal/shared/hwid"
)

// BootedFile is the booted file's name in the data directory.
const BootedFile = "booted.jsonl"

// MaxLine bounds one line of the booted file.
const MaxLine = 1024

// Machine is a machine the site booted (its boot, checked by
// hwid.Boot.Check).
type Machine = hwid.Boot

// BootedPath is the booted file of a data directory.
func BootedPath(dataDir string) string { return filepath.Join(dataDir, BootedFile) }

// Append records a boot: one line appended to the booted file (created
// 0600). A line shorter than the pipe buffer is written with one write, so
// concurrent appenders do not interleave.
func Append(path string, m Machine) error {
	m, err := m.Check()
	if err != nil {
		return err
	}
	line, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("create %s: %w", filepath.Dir(path), err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("open the booted file: %w", err)
	}
	if _, err := f.Write(append(line, '\n')); err != nil {
		f.Close()
		return fmt.Errorf("record the boot: %w", err)
	}
	return f.Close()
}

// Read returns the booted machines, the newest boot per MAC (highest lease
// epoch; a later line wins a tie), in MAC order. A missing file is no
// machine. Lines that do not parse or check are skipped and counted.
func Read(path string) (machines []Machine, skipped int, err error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, 0, nil
	} else if err != nil {
		return nil, 0, fmt.Errorf("read the booted file: %w", err)
	}
	defer f.Close()
	byMAC := map[string]Machine{}
	r := bufio.NewReaderSize(f, MaxLine+1)
	for {
		line, err := r.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			skipped++
			for errors.Is(err, bufio.ErrBufferFull) { // skip the rest of the long line
				_, err = r.ReadSlice('\n')
			}
			continue
		}
		if len(line) > 0 && (err == nil || errors.Is(err, io.EOF)) {
			var m Machine
			if json.Unmarshal(line, &m) != nil {
				skipped++
			} else if m, cerr := m.Check(); cerr != nil {
				skipped++
			} else if prev, ok := byMAC[m.MAC]; !ok || m.LeaseEpoch >= prev.LeaseEpoch {
				byMAC[m.MAC] = m
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, skipped, fmt.Errorf("read the booted file: %w", err)
		}
	}
	for _, m := range byMAC {
		machines = append(machines, m)
	}
	sort.Slice(machines, func(i, j int) bool { return machines[i].MAC < machines[j].MAC })
	return machines, skipped, nil
}
