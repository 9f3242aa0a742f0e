package api

import (
	"errors"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
)

// R11.5: the API serves the bcd builds the install script downloads, from
// Config.DownloadsDir laid out as bcd/{version}/linux-{arch}:
//
//	GET {basePath}/downloads/bcd/{version}/linux-{arch}
//
// The route needs no credentials: the builds are public, and the script
// trusts a download only through the SHA-256 it embeds.
//
// SECURITY: the version and the arch are checked against strict alphabets
// before they touch the filesystem, and the file is opened through os.Root,
// so neither "..", an encoded slash nor a symlink reaches outside the
// directory. Anything else answers 404, and directories are never listed.

// maxDownloadVersionLen bounds the version segment.
const maxDownloadVersionLen = 64

// mountDownloads adds the downloads route when a directory is configured.
func (s *Server) mountDownloads() {
	if s.cfg.DownloadsDir == "" {
		return
	}
	s.mux.HandleFunc("GET "+s.cfg.BasePath+"/downloads/bcd/{version}/{file}", s.downloadBCD)
}

func (s *Server) downloadBCD(w http.ResponseWriter, r *http.Request) {
	version, file := r.PathValue("version"), r.PathValue("file")
	if !validDownloadVersion(version) || (file != "linux-amd64" && file != "linux-arm64") {
		http.NotFound(w, r)
		return
	}
	root, err := os.OpenRoot(s.cfg.DownloadsDir)
	if err != nil {
		s.lines.LogContext(r.Context(), slog.LevelError, "downloads-dir", "downloads directory", "dir", s.cfg.DownloadsDir, "err", err)
		http.NotFound(w, r)
		return
	}
	defer root.Close()
	f, err := root.Open("bcd/" + version + "/" + file)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			s.lines.LogContext(r.Context(), slog.LevelWarn, "download", "download", "version", version, "file", file, "err", err)
		}
		http.NotFound(w, r)
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() {
		http.NotFound(w, r)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Content-Disposition", `attachment; filename="bcd"`)
	h.Set("Cache-Control", "public, max-age=300")
	// ServeContent sets Content-Length and answers ranges and
	// If-Modified-Since; the name has no extension, so the type stays.
	http.ServeContent(w, r, file, st.ModTime(), f)
}

// validDownloadVersion accepts [0-9A-Za-z.+-], starting with a letter or
// digit (so never "." or ".."), with no "..", at most 64 characters.
func validDownloadVersion(v string) bool {
	if v == "" || len(v) > maxDownloadVersionLen {
		return false
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		switch {
		case c >= '0' && c <= '9', c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z':
		case (c == '.' || c == '+' || c == '-') && i > 0:
			if c == '.' && v[i-1] == '.' {
				return false
			}
		default:
			return false
		}
	}
	return true
}
